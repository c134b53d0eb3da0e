#!/usr/bin/env bash
# #27: small device batches sent on the consumer's stream (small) against c15aa12 (after2);
# zero-copy against copy mode across workers; where the fork's extra mappings come from.
set -u
mkdir -p $OUT
for w in after2 small; do python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl; done
start=$(date +%s)
PYTHONPATH=/tmp/psmall timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "cuda tests: exit $? in $(( $(date +%s) - start )) s"; tail -3 $OUT/cuda-tests.log
L="torch-pinned pinpool pinpool-device pinpool-zerocopy"
for round in 1 2; do
  for w in small after2; do
    PYTHONPATH=/tmp/p$w timeout 100 python3 -m pinpool.bench --out $OUT/tok/$w-$round --workloads tokens \
      --modes throughput --repeats 2 --loaders $L > $OUT/tok-$w-$round.log 2>&1
    echo "== tokens $w round $round: exit $?"; grep -E "^  (GB/s|us per batch|CPU ms)" $OUT/tok-$w-$round.log
  done
done
for n in 2 8 14; do
  PYTHONPATH=/tmp/psmall timeout 100 python3 -m pinpool.bench --out $OUT/syn$n --workloads synthetic \
    --modes throughput --workers $n --repeats 2 --loaders pinpool pinpool-device pinpool-zerocopy > $OUT/syn-$n.log 2>&1
  echo "== synthetic $n workers: exit $?"; grep -E "^  (GB/s|next\(\) ms, p99|time to first|end of epoch)|batches went" $OUT/syn-$n.log
done
PYTHONPATH=/tmp/psmall timeout 120 python3 -m pinpool.bench --out $OUT/stall --workloads synthetic \
  --modes stall --repeats 2 --loaders pinpool pinpool-device pinpool-zerocopy > $OUT/stall.log 2>&1
echo "== stall: exit $?"; grep -E "^  (GB/s|time to first|end of epoch|step ms, max)|batches went" $OUT/stall.log
PYTHONPATH=/tmp/psmall timeout 90 python3 .gpu/forkmaps.py > $OUT/forkmaps.log 2>&1; echo "== forkmaps: exit $?"; cat $OUT/forkmaps.log | grep -v Warn
