#!/usr/bin/env bash
# GPU session A: integration smoke on CUDA, step time, GPU tests, lm_head benchmark.
set -u
. notes/device_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch,triton,lightning,sys;print(sys.version.split()[0],torch.__version__,triton.__version__,lightning.__version__)"
echo "=== quickstart on GPU (30 steps)"
( cd /tmp && timeout 150 python3 $OLDPWD/main.py fit --config $OLDPWD/configs/quickstart.yaml --trainer.max_steps 30 \
    --trainer.enable_progress_bar false --data.val_tokens 65536 ) > $OUT/quickstart.log 2>&1; echo "rc=$?"
tail -4 $OUT/quickstart.log; grep -h "val/loss\|Error\|error" $OUT/quickstart.log | tail -5
python3 - <<'PY'
import csv, glob
for f in glob.glob('/tmp/logs/quickstart/csv/*/metrics.csv'):
    r = list(csv.DictReader(open(f)))
    print([(x['step'], x.get('train/tokens_per_s'), x.get('train/loss'), x.get('val/loss')) for x in r if x.get('train/loss') or x.get('val/loss')][-4:])
PY
echo "=== step_time speedrun_1gpu stage 0, eager"
timeout 200 python3 benchmarks/step_time.py --config configs/speedrun_1gpu.yaml --stage 0 --steps 8 --warmup 3 \
    --set model.compile=false > $OUT/step_time_eager.log 2>&1; echo "rc=$?"; tail -12 $OUT/step_time_eager.log
echo "=== GPU tests"
timeout 170 python3 -m pytest -q -m cuda -p no:cacheprovider tests > $OUT/gpu_tests.log 2>&1; echo "rc=$?"
grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -30
echo "=== lm_head_loss benchmark"
timeout 90 python3 benchmarks/lm_head_loss.py --quick > $OUT/lm_head.log 2>&1; echo "rc=$?"; tail -22 $OUT/lm_head.log
