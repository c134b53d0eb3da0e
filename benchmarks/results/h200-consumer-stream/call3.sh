#!/usr/bin/env bash
# #27: zero-copy, big reservations only where the worker keeps a window (only) against win.
set -u
mkdir -p $OUT
for w in win only; do python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl; done
for w in only win; do
  PYTHONPATH=/tmp/p$w timeout 120 python3 -m pinpool.bench --out $OUT/r/stall-$w --workloads synthetic \
    --modes stall --repeats 2 --loaders pinpool pinpool-device pinpool-zerocopy > $OUT/stall-$w.log 2>&1
  echo "== stall $w: exit $?"; grep -E "^  (GB/s|end of epoch|step ms, max)|batches went" $OUT/stall-$w.log
done
for n in 8 2; do
  PYTHONPATH=/tmp/ponly timeout 100 python3 -m pinpool.bench --out $OUT/r/syn$n --workloads synthetic \
    --modes throughput --workers $n --repeats 2 --loaders pinpool pinpool-device pinpool-zerocopy > $OUT/syn-$n.log 2>&1
  echo "== synthetic $n workers, only: exit $?"; grep -E "^  (GB/s|end of epoch)|batches went" $OUT/syn-$n.log
done
PYTHONPATH=/tmp/ponly timeout 100 python3 -m pinpool.bench --out $OUT/r/tok --workloads tokens \
  --modes throughput --repeats 2 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy > $OUT/tok-only.log 2>&1
echo "== tokens only: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/tok-only.log
start=$(date +%s)
PYTHONPATH=/tmp/ponly timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "cuda tests: exit $? in $(( $(date +%s) - start )) s"; tail -2 $OUT/cuda-tests.log
