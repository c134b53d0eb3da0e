#!/usr/bin/env bash
# #27 item 3 on the H200, third call: head = 692690a, win = 923fb7d (a keyed window opened and
# closed with the GIL held, kept windows found by their bounds in Python), hold = win with the
# slot's send to the device made with the GIL held (an experiment, branch exp-hold, 6bdc6b9).
# Keyed window tests and CUDA tests with win; then tokens (bench, and benchmarks/mode_costs.py)
# three rounds, the three wheels alternating.
set -u
mkdir -p $OUT/r
for w in head win hold; do
  python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl
done
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
T="env PYTHONPATH=/tmp/pwin:$PWD/tests PINPOOL_REQUIRE_PKEYS=1 python3 -m pytest -q -p no:cacheprovider"
timeout 150 $T tests/unit/test_windows.py tests/unit/test_reservations.py tests/faults/test_hardening.py -k "window or reservation or arena or ahead or planned or tagged or worked_out or plan or ticket or writer" > $OUT/pkeys-tests.log 2>&1
echo "== keyed window tests (win): exit $?"; tail -n 1 $OUT/pkeys-tests.log; t
timeout 200 env PYTHONPATH=/tmp/pwin:$PWD/tests python3 -m pytest -q -p no:cacheprovider -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "== cuda tests (win): exit $?"; tail -n 1 $OUT/cuda-tests.log; t
for i in 1 2 3; do
  for w in head win hold; do
    PYTHONPATH=/tmp/p$w timeout 90 python3 -m pinpool.bench --out $OUT/r/tok-$w-$i --workloads tokens --modes throughput --repeats 3 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy >> $OUT/tok-$w.log 2>&1
    echo "== tok $w: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/tok-$w.log | tail -2; t
    PYTHONPATH=/tmp/p$w timeout 120 python3 benchmarks/mode_costs.py --rounds 1 --out $OUT/r/costs-$w-$i.json > $OUT/costs.tmp 2>&1
    echo "== mode_costs $w: exit $?"; grep -E "^(cpu|device|zero-copy) " $OUT/costs.tmp; cat $OUT/costs.tmp >> $OUT/costs-$w.log; t
  done
done
rm -f $OUT/costs.tmp
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
cat $OUT/tok-*.log $OUT/costs-*.log > $OUT/all.log; rm -f $OUT/tok-*.log $OUT/costs-*.log
