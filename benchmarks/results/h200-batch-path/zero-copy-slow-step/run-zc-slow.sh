#!/usr/bin/env bash
set -u
pip install -q --no-deps --no-index --target /tmp/site dist/final/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 150 python3 scratch/zc_slow.py 2>&1 | grep -v Warning | tee $OUT/zc_slow.txt
