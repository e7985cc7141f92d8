#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
timeout 120 python3 notes/fp8_diag.py 2>&1 | tail -30
timeout 100 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_fp8.py -x -k "gpu_fast_mlp and shape0 and elementwise" 2>&1 | grep -E "^E|passed|failed" | head -15
