#!/usr/bin/env bash
# #27 item 3 on the H200, first call: where small batches' time goes by mode (head = 692690a).
# benchmarks/mode_costs.py (per-thread run and runnable-wait time, workers' CPU, index puts,
# worker.place by kind), its pipe writers at nice 0 and 10 alternating; two reference bench
# runs of tokens; py-spy --gil of pinned CPU batches and zero-copy.
set -u
mkdir -p $OUT/r
python3 -m pip install -q --no-deps --no-index --target /tmp/phead .gpu/head/*.whl
python3 -m pip install -q --no-deps --no-index --target /tmp/spy .gpu/tools/py_spy-*.whl
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
for i in 1 2; do
  for n in 0 10; do
    PYTHONPATH=/tmp/phead timeout 120 python3 benchmarks/mode_costs.py --rounds 2 --pipe-nice $n --out $OUT/r/costs-nice$n-$i.json > $OUT/costs-nice$n-$i.log 2>&1
    echo "== mode_costs nice $n: exit $?"; grep -v "^   [a-z]" $OUT/costs-nice$n-$i.log | grep -v Warn | tail -30; t
  done
done
for i in 1 2; do
  PYTHONPATH=/tmp/phead timeout 90 python3 -m pinpool.bench --out $OUT/r/tok-head-$i --workloads tokens --modes throughput --repeats 3 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy >> $OUT/tok.log 2>&1
  echo "== tok head: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/tok.log | tail -2; t
done
for l in pinpool pinpool-zerocopy; do
  PYTHONPATH=/tmp/phead timeout 90 /tmp/spy/bin/py-spy record --gil --nonblocking -r 500 -f raw -o $OUT/r/spy-$l-gil.txt -- \
    python3 -m pinpool.bench --out $OUT/r/spy-$l --workloads tokens --modes throughput --repeats 3 --loaders $l >> $OUT/spy.log 2>&1
  echo "== py-spy $l --gil: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/spy.log | tail -2; t
done
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
cat $OUT/costs-*.log $OUT/tok.log $OUT/spy.log > $OUT/all.log; rm -f $OUT/costs-*.log $OUT/tok.log $OUT/spy.log
