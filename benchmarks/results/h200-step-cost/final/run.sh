#!/usr/bin/env bash
# Final figures for the step-cost work: GPU tests, stall (forkserver), compute, tokens, step gaps, first batch.
set -u
pip install -q --no-deps --no-index --target /tmp/site dist/final/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$(pwd); cd $OUT
(cd $R; timeout 120 python3 -m pytest -q tests/test_cuda.py tests/test_loader_cuda.py tests/test_batch_path.py tests/test_segments.py tests/test_pool_hint.py tests/test_release.py > $OUT/gpu-tests.log 2>&1); tail -1 gpu-tests.log
L="torch-pinned pinpool pinpool-device pinpool-zerocopy"
timeout 130 python3 -m pinpool.bench --workload synthetic --modes stall --repeats 3 --loaders $L --start-method forkserver --out stall-forkserver > stall-forkserver.log 2>&1
timeout 130 python3 -m pinpool.bench --workload synthetic --modes compute --repeats 3 --loaders $L --out compute > compute.log 2>&1
timeout 70 python3 -m pinpool.bench --workload tokens --modes throughput --repeats 3 --loaders $L --out tokens > tokens.log 2>&1
timeout 50 python3 $R/benchmarks/step_gap.py --loaders $L --probe > step-gap.txt 2>&1
timeout 40 python3 $R/benchmarks/first_batch.py --rounds 3 > first-batch.txt 2>&1
rm -f */*.png
echo "== stall"; grep -A7 "whole life" stall-forkserver.log | tail -7; grep -E "time to first" stall-forkserver.log | tail -1
echo "== compute"; grep -E "GPU idle|next\(\) ms|time to first" compute.log | tail -5
echo "== tokens"; grep -E "GB/s  |us per batch" tokens.log
grep -E "^torch|^pinpool" step-gap.txt
grep -E "first@" first-batch.txt | cut -c1-60
tar czf final.tgz stall-forkserver compute tokens && rm -rf stall-forkserver compute tokens
ls
