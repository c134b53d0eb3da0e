#!/usr/bin/env bash
# #27 item 3 on the H200, fourth call: gil = the commit that keeps the GIL in
# Slot.send_then_release (on top of call 3's win), against head = 692690a. Keyed window tests
# and CUDA tests with gil (the new GIL test included); tokens (bench, and
# benchmarks/mode_costs.py) four rounds, the two wheels alternating; one synthetic
# (38.5 MB batches, 8 workers) throughput run of each.
set -u
mkdir -p $OUT/r
for w in head gil; do
  python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl
done
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
T="env PYTHONPATH=/tmp/pgil:$PWD/tests PINPOOL_REQUIRE_PKEYS=1 python3 -m pytest -q -p no:cacheprovider"
timeout 150 $T tests/unit/test_windows.py tests/unit/test_reservations.py tests/faults/test_hardening.py -k "window or reservation or arena or ahead or planned or tagged or worked_out or plan or ticket or writer" > $OUT/pkeys-tests.log 2>&1
echo "== keyed window tests (gil): exit $?"; tail -n 1 $OUT/pkeys-tests.log; t
timeout 200 env PYTHONPATH=/tmp/pgil:$PWD/tests python3 -m pytest -q -p no:cacheprovider -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "== cuda tests (gil): exit $?"; tail -n 1 $OUT/cuda-tests.log; grep -E "gil|FAIL" $OUT/cuda-tests.log | head -5; t
for i in 1 2 3 4; do
  for w in head gil; do
    PYTHONPATH=/tmp/p$w timeout 90 python3 -m pinpool.bench --out $OUT/r/tok-$w-$i --workloads tokens --modes throughput --repeats 3 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy >> $OUT/tok-$w.log 2>&1
    echo "== tok $w: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/tok-$w.log | tail -2; t
    PYTHONPATH=/tmp/p$w timeout 120 python3 benchmarks/mode_costs.py --rounds 1 --out $OUT/r/costs-$w-$i.json > $OUT/costs.tmp 2>&1
    echo "== mode_costs $w: exit $?"; grep -E "^(cpu|device|zero-copy) " $OUT/costs.tmp; cat $OUT/costs.tmp >> $OUT/costs-$w.log; t
  done
done
rm -f $OUT/costs.tmp
for w in head gil; do
  PYTHONPATH=/tmp/p$w timeout 120 python3 -m pinpool.bench --out $OUT/r/syn-$w --workloads synthetic --modes throughput --repeats 2 --loaders pinpool pinpool-device pinpool-zerocopy >> $OUT/syn-$w.log 2>&1
  echo "== synthetic $w: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/syn-$w.log | tail -2; t
done
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
cat $OUT/tok-*.log $OUT/costs-*.log $OUT/syn-*.log > $OUT/all.log; rm -f $OUT/tok-*.log $OUT/costs-*.log $OUT/syn-*.log
