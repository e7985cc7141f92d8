#!/usr/bin/env bash
# GPU session B: quickstart on CUDA, compiled step time (Lightning vs plain), FP8 and optimizer benchmarks.
set -u
. notes/device_env.sh || exit 1
R=$PWD
echo "=== quickstart on GPU (full config)"
( cd /tmp && timeout 100 python3 $R/main.py fit --config $R/configs/quickstart.yaml --trainer.enable_progress_bar false ) > $OUT/quickstart.log 2>&1; echo "rc=$?"
grep -h "Error" $OUT/quickstart.log | tail -3
python3 - <<'PY'
import csv, glob
for f in glob.glob('/tmp/logs/quickstart/csv/*/metrics.csv'):
    r = list(csv.DictReader(open(f)))
    print([(x['step'], x.get('train/tokens_per_s'), x.get('train/loss'), x.get('val/loss')) for x in r if x.get('train/loss') or x.get('val/loss')][-3:])
PY
echo "=== step_time speedrun_1gpu stage 0, compiled"
timeout 280 python3 benchmarks/step_time.py --config configs/speedrun_1gpu.yaml --stage 0 --steps 10 --warmup 4 \
    > $OUT/step_time_compiled.log 2>&1; echo "rc=$?"; tail -8 $OUT/step_time_compiled.log
echo "=== fp8 benchmark"
timeout 90 python3 benchmarks/fp8_mlp.py --quick > $OUT/fp8.log 2>&1; echo "rc=$?"; tail -25 $OUT/fp8.log
echo "=== optimizer step benchmark"
timeout 110 python3 benchmarks/optimizer_step.py --quick > $OUT/optim.log 2>&1; echo "rc=$?"; tail -25 $OUT/optim.log
