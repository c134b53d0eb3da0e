#!/usr/bin/env bash
# #27 item 3 on the H200, second call (head = 692690a): py-spy --subprocesses of pinned CPU
# batches and zero-copy (where the workers' CPU goes in each mode), and
# benchmarks/mode_costs.py with 4 and 8 workers (do the modes part when workers are plenty?).
set -u
mkdir -p $OUT/r
python3 -m pip install -q --no-deps --no-index --target /tmp/phead .gpu/head/*.whl
python3 -m pip install -q --no-deps --no-index --target /tmp/spy .gpu/tools/py_spy-*.whl
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
for l in pinpool pinpool-zerocopy; do
  PYTHONPATH=/tmp/phead timeout 120 /tmp/spy/bin/py-spy record --subprocesses --nonblocking -r 400 -f raw -o $OUT/r/spy-$l-sub.txt -- \
    python3 -m pinpool.bench --out $OUT/r/spy-$l --workloads tokens --modes throughput --repeats 3 --token-steps 6000 --loaders $l >> $OUT/spy.log 2>&1
  echo "== py-spy $l --subprocesses: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/spy.log | tail -2; t
done
for w in 4 8 4 8; do
  PYTHONPATH=/tmp/phead timeout 120 python3 benchmarks/mode_costs.py --rounds 2 --workers $w --out $OUT/r/costs-w$w-$(date +%s).json > $OUT/costs.log.tmp 2>&1
  echo "== mode_costs $w workers: exit $?"; grep -E "^(cpu|device|zero-copy|tokens) " $OUT/costs.log.tmp; cat $OUT/costs.log.tmp >> $OUT/costs.log; t
done
rm -f $OUT/costs.log.tmp
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
cat $OUT/spy.log $OUT/costs.log > $OUT/all.log; rm -f $OUT/spy.log $OUT/costs.log
