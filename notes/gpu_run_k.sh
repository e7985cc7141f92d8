#!/usr/bin/env bash
# GPU session K: the full speedrun_1gpu recipe through main.py, as a 24-step miniature (notes/gpu_smoke.yaml).
set -u
. notes/device_env.sh || exit 1
( timeout 300 python3 main.py fit --config configs/speedrun_1gpu.yaml --config notes/gpu_smoke.yaml \
    --trainer.enable_progress_bar false ) > $OUT/smoke.log 2>&1; echo "rc=$?"
grep -iE "error|warn|speedrun|Traceback" $OUT/smoke.log | grep -v "UserWarning: The given NumPy" | head -20
tail -5 $OUT/smoke.log
python3 - <<'PY'
import csv, glob
for f in glob.glob('logs/gpu_smoke/csv/*/metrics.csv'):
    rows = list(csv.DictReader(open(f)))
    keys = [k for k in rows[0] if k in ("step", "train/loss", "val/loss", "lr", "train/tokens_per_s", "speedrun/train_time_s", "speedrun/reached_target")]
    for r in rows:
        vals = {k: r[k] for k in keys if r.get(k)}
        if len(vals) > 1:
            print(vals)
PY
echo "=== host profile of a stage-0 step (plain loop, eager)"
timeout 200 python3 benchmarks/step_time.py --config configs/speedrun_1gpu.yaml --stage 0 --steps 3 --warmup 2 \
    --only plain --cprofile --set model.compile=false > $OUT/cprofile.log 2>&1; echo "rc=$?"
grep -A40 "tottime" $OUT/cprofile.log | head -45 | cut -c1-160
tail -3 $OUT/cprofile.log
