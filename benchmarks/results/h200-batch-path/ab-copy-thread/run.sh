#!/usr/bin/env bash
# b: direct index puts; c: b + the pin thread's copies of CPU batches on a copy thread (consumer waits); d: c + copies of 64 KiB+ release the GIL (device path's copy).
set -u
for v in b c d; do pip install -q --no-deps --no-index --target /tmp/site-$v dist/$v/*.whl >/dev/null 2>&1; done
export PYTHONUNBUFFERED=1
R=$(pwd); cd $OUT
L="torch-pinned pinpool pinpool-device pinpool-zerocopy"
for round in 1 2; do for v in b c d; do
  PYTHONPATH=/tmp/site-$v timeout 60 python3 -m pinpool.bench --workload tokens --modes throughput --repeats 1 --loaders $L --out tok-$v-$round > tok-$v-$round.log 2>&1
  rm -rf tok-$v-$round
done; done
for v in b c d; do
  PYTHONPATH=/tmp/site-$v timeout 80 python3 -m pinpool.bench --workload synthetic --modes compute --repeats 1 --loaders $L --out cmp-$v > cmp-$v.log 2>&1
  rm -rf cmp-$v
done
PYTHONPATH=/tmp/site-c timeout 60 python3 $R/benchmarks/next_profile.py --workload tokens --loader pinpool --steps 3000 > prof-c-none.txt 2>&1
cd $R; PYTHONPATH=/tmp/site-c timeout 120 python3 -m pytest -q -x tests/test_cuda.py tests/test_pool.py tests/test_release.py tests/test_batch_path.py tests/test_segments.py > $OUT/gpu-tests-c.log 2>&1
cd $OUT
for round in 1 2; do for v in b c d; do echo "== tok $v $round"; grep -E "GB/s  |us per batch" tok-$v-$round.log | tail -2; done; done
for v in b c d; do echo "== cmp $v"; grep -E "GPU idle|next\(\) ms" cmp-$v.log | tail -3; done
mkdir -p logs; mv tok-*.log cmp-*.log logs/; tar czf logs.tgz logs; rm -rf logs
tail -2 gpu-tests-c.log
head -1 prof-c-none.txt; grep -A6 "CPU time per batch" prof-c-none.txt
