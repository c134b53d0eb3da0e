#!/usr/bin/env bash
# Final code (c5c7cae + stub): stall (forkserver, fork), compute x3, tokens x3, profiles, GPU tests.
set -u
pip install -q --no-deps --no-index --target /tmp/site dist/final/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$(pwd); cd $OUT
L="torch-pinned pinpool pinpool-device pinpool-zerocopy"
timeout 130 python3 -m pinpool.bench --workload synthetic --modes stall --repeats 3 --loaders $L --start-method forkserver --out stall-forkserver > stall-forkserver.log 2>&1
timeout 130 python3 -m pinpool.bench --workload synthetic --modes compute --repeats 3 --loaders $L --out compute > compute.log 2>&1
timeout 70 python3 -m pinpool.bench --workload tokens --modes throughput --repeats 3 --loaders $L --out tokens > tokens.log 2>&1
timeout 90 python3 -m pinpool.bench --workload synthetic --modes stall --repeats 2 --loaders $L --out stall-fork > stall-fork.log 2>&1
for d in none cuda; do
  D=""; [ $d = cuda ] && D="--device cuda"
  timeout 40 python3 $R/benchmarks/next_profile.py --workload tokens --loader pinpool $D --steps 3000 > prof-$d.txt 2>&1
done
rm -f */*.png
cd $R; timeout 100 python3 -m pytest -q -x tests/test_cuda.py tests/test_pool.py tests/test_release.py tests/test_batch_path.py tests/test_segments.py > $OUT/gpu-tests.log 2>&1
cd $OUT
for f in stall-forkserver stall-fork; do echo "== $f"; grep -A7 "whole life" $f.log | tail -7; grep -E "time to first" $f.log | tail -1; done
echo "== compute"; grep -E "GPU idle|next\(\) ms" compute.log | tail -3
echo "== tokens"; grep -E "GB/s  |us per batch" tokens.log
for d in none cuda; do head -1 prof-$d.txt; done
tail -1 gpu-tests.log

tar czf final.tgz stall-forkserver* stall-fork* compute* tokens* prof-*.txt gpu-tests.log && rm -rf stall-forkserver* stall-fork* compute* tokens* prof-*.txt
ls
