#!/usr/bin/env bash
# GPU session C: profile of a speedrun step, FP8/n-gram/optimizer-quality benchmarks, quickstart, stage-2 step time.
set -u
. notes/device_env.sh || exit 1
R=$PWD
echo "=== profile: speedrun_1gpu stage 0, eager, plain loop"
timeout 100 python3 benchmarks/step_time.py --config configs/speedrun_1gpu.yaml --stage 0 --steps 2 --warmup 2 \
    --only plain --profile --set model.compile=false > $OUT/profile.log 2>&1; echo "rc=$?"
grep -A34 "Self CUDA %" $OUT/profile.log | head -36 | cut -c1-60,100-200
echo "=== fp8 GPU tests + benchmark"
timeout 60 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_polar_triton.py tests/test_anvil.py 2>&1 | tail -3
timeout 80 python3 benchmarks/fp8_mlp.py --quick > $OUT/fp8.log 2>&1; echo "rc=$?"; tail -22 $OUT/fp8.log
echo "=== quickstart on GPU (full config)"
( cd /tmp && timeout 90 python3 $R/main.py fit --config $R/configs/quickstart.yaml --trainer.enable_progress_bar false ) > $OUT/quickstart.log 2>&1; echo "rc=$?"
grep -h "Error" $OUT/quickstart.log | tail -3
python3 - <<'PY'
import csv, glob
for f in glob.glob('/tmp/logs/quickstart/csv/*/metrics.csv'):
    r = list(csv.DictReader(open(f)))
    print([(x['step'], x.get('train/tokens_per_s'), x.get('train/loss'), x.get('val/loss')) for x in r if x.get('train/loss') or x.get('val/loss')][-2:])
PY
echo "=== n-gram table benchmark"
timeout 100 python3 benchmarks/ngram_table.py --quick --part table > $OUT/ngram.log 2>&1; echo "rc=$?"; tail -20 $OUT/ngram.log
echo "=== optimizer quality"
timeout 150 python3 benchmarks/optimizer_quality.py --quick > $OUT/quality.log 2>&1; echo "rc=$?"; tail -14 $OUT/quality.log
