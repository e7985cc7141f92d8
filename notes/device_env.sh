# Sourced by notes/gpu_run_*.sh on the device machine: the carried wheels (.whl: jsonargparse and
# its two dependencies, missing there) and the carried tiktoken cache (.device/tiktoken).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD
export TIKTOKEN_CACHE_DIR=$PWD/.device/tiktoken
