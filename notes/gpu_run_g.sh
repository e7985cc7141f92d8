#!/usr/bin/env bash
# GPU session G: verify the e5m2 transpose fix, ANVIL CUDA graphs (tests + step time), FP8 MLP profile,
# optimizer quality with an lr sweep on a larger corpus.
set -u
. notes/device_env.sh || exit 1
echo "=== GPU tests: FP8 + ANVIL"
timeout 170 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_fp8_layouts.py tests/test_fp8.py \
    tests/test_fp8_training.py tests/test_anvil.py > $OUT/gpu_tests.log 2>&1; echo "rc=$?"
grep -E "^E |passed|failed|FAILED" $OUT/gpu_tests.log | head -20
echo "=== optimizer step"
timeout 100 python3 benchmarks/optimizer_step.py --quick > $OUT/optim.log 2>&1; echo "rc=$?"; tail -24 $OUT/optim.log
echo "=== fp8 MLP with profile"
timeout 70 python3 benchmarks/fp8_mlp.py --quick --skip-head --profile > $OUT/fp8.log 2>&1; echo "rc=$?"
grep -E "^MLP|best" $OUT/fp8.log
echo "=== optimizer quality sweep"
timeout 240 python3 benchmarks/optimizer_quality.py --model small --text installed --steps 400 \
    --sweep 0.5 1 2 > $OUT/quality.log 2>&1; echo "rc=$?"; grep -v "step " $OUT/quality.log | tail -22
