#!/usr/bin/env bash
# a: f8b808f; e: a + device batches copied into the slot and on to the device in one Rust call (SegmentCache.copy_to_device, Sent.make_wait).
set -u
for v in a e; do pip install -q --no-deps --no-index --target /tmp/site-$v dist/$v/*.whl >/dev/null 2>&1; done
export PYTHONUNBUFFERED=1
R=$(pwd); cd $OUT
L="torch-pinned pinpool pinpool-device pinpool-zerocopy"
cd $R; PYTHONPATH=/tmp/site-e timeout 150 python3 -m pytest -q -x tests/test_cuda.py tests/test_loader_cuda.py tests/test_batch_path.py tests/test_segments.py > $OUT/gpu-tests-e.log 2>&1; cd $OUT
tail -1 gpu-tests-e.log
for round in 1 2; do for v in a e; do
  PYTHONPATH=/tmp/site-$v timeout 60 python3 -m pinpool.bench --workload tokens --modes throughput --repeats 1 --loaders $L --out tok-$v-$round > tok-$v-$round.log 2>&1
  rm -rf tok-$v-$round
done; done
for v in a e; do
  PYTHONPATH=/tmp/site-$v timeout 100 python3 -m pinpool.bench --workload synthetic --modes compute --repeats 2 --loaders pinpool-device pinpool --out cmp-$v > cmp-$v.log 2>&1
  rm -rf cmp-$v
done
PYTHONPATH=/tmp/site-e timeout 40 python3 $R/benchmarks/next_profile.py --workload tokens --loader pinpool --device cuda --steps 3000 > prof-e-cuda.txt 2>&1
for round in 1 2; do for v in a e; do echo "== tok $v $round"; grep -E "GB/s  |us per batch" tok-$v-$round.log | tail -2; done; done
for v in a e; do echo "== cmp $v"; grep -E "GPU idle|next\(\) ms" cmp-$v.log | tail -3; done
head -1 prof-e-cuda.txt; grep -A6 "CPU time per batch" prof-e-cuda.txt
mkdir -p logs; mv tok-*.log cmp-*.log prof-e-cuda.txt logs/; tar czf logs.tgz logs; rm -rf logs
