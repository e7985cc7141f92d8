#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
timeout 110 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_fp8_layouts.py tests/test_fp8.py tests/test_fp8_training.py 2>&1 | grep -E "^E|passed|failed|FAILED" | head -12
timeout 70 python3 benchmarks/fp8_mlp.py --quick --skip-head 2>&1 | grep -E "^MLP|best|group" | head -8
