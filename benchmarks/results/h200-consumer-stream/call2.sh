#!/usr/bin/env bash
# #27: zero-copy with kept windows and preferred slots (win) against ed1722d (small).
set -u
mkdir -p $OUT
for w in small win; do python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl; done
start=$(date +%s)
PYTHONPATH=/tmp/pwin timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "cuda tests: exit $? in $(( $(date +%s) - start )) s"; tail -2 $OUT/cuda-tests.log
for n in 2 8 14; do
  PYTHONPATH=/tmp/pwin timeout 100 python3 -m pinpool.bench --out $OUT/r/syn$n --workloads synthetic \
    --modes throughput --workers $n --repeats 2 --loaders pinpool pinpool-device pinpool-zerocopy > $OUT/syn-$n.log 2>&1
  echo "== synthetic $n workers: exit $?"; grep -E "^  (GB/s|next\(\) ms, p99|end of epoch)|batches went" $OUT/syn-$n.log
done
PYTHONPATH=/tmp/pwin timeout 120 python3 -m pinpool.bench --out $OUT/r/stall --workloads synthetic \
  --modes stall --repeats 2 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy > $OUT/stall.log 2>&1
echo "== stall: exit $?"; grep -E "^  (GB/s|time to first|end of epoch|step ms, max)|batches went" $OUT/stall.log
L="torch-pinned pinpool pinpool-device pinpool-zerocopy"
for w in win small win; do
  PYTHONPATH=/tmp/p$w timeout 100 python3 -m pinpool.bench --out $OUT/r/tok-$w --workloads tokens \
    --modes throughput --repeats 2 --loaders $L > $OUT/tok-$w-$SECONDS.log 2>&1
  echo "== tokens $w: exit $?"; grep -h -E "^  (GB/s|us per batch)" $OUT/tok-$w-*.log | tail -2
done
