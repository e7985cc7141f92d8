#!/usr/bin/env bash
# GPU session D: the whole GPU test suite, optimizer quality at 400 steps, stage-2 step time.
set -u
. notes/device_env.sh || exit 1
echo "=== GPU tests"
timeout 170 python3 -m pytest -q -m cuda -p no:cacheprovider tests > $OUT/gpu_tests.log 2>&1; echo "rc=$?"
grep -E "passed|failed|FAILED" $OUT/gpu_tests.log | tail -12
echo "=== optimizer quality, 400 steps"
timeout 120 python3 benchmarks/optimizer_quality.py > $OUT/quality.log 2>&1; echo "rc=$?"; tail -8 $OUT/quality.log
echo "=== step_time speedrun_1gpu stage 2, eager"
timeout 200 python3 benchmarks/step_time.py --config configs/speedrun_1gpu.yaml --stage 2 --steps 6 --warmup 3 \
    --set model.compile=false > $OUT/step_time_stage2.log 2>&1; echo "rc=$?"; tail -8 $OUT/step_time_stage2.log
