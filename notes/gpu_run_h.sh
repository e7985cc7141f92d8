#!/usr/bin/env bash
# GPU session H: the byte-transpose fix of the e5m2 tiles, FP8 benchmark, full-step time with ANVIL graphs.
set -u
. notes/device_env.sh || exit 1
echo "=== GPU tests: FP8 + ANVIL"
timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_fp8_layouts.py tests/test_fp8.py \
    tests/test_fp8_training.py tests/test_anvil.py > $OUT/gpu_tests.log 2>&1; echo "rc=$?"
grep -E "^E |passed|failed|FAILED" $OUT/gpu_tests.log | head -20
echo "=== fp8 benchmark"
timeout 110 python3 benchmarks/fp8_mlp.py --quick --profile > $OUT/fp8.log 2>&1; echo "rc=$?"
grep -E "^MLP|^lm_head|best" $OUT/fp8.log
echo "=== step_time speedrun_1gpu stage 2, eager"
timeout 260 python3 benchmarks/step_time.py --config configs/speedrun_1gpu.yaml --stage 2 --steps 6 --warmup 3 \
    --set model.compile=false > $OUT/step_time_s2.log 2>&1; echo "rc=$?"; tail -8 $OUT/step_time_s2.log
