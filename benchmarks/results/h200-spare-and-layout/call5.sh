#!/usr/bin/env bash
# #27 items 3 and 4 on the H200, fifth call: inode = c559749 (each
# memfd part's inode read once; the rule of f0f340c reverted) against fix = 0fe8739. The keyed
# and CUDA tests with inode; benchmarks/reservation_cost.py with each wheel; tokens
# (throughput) three rounds, fix and inode alternating.
set -u
mkdir -p $OUT/r
for w in fix inode; do
  python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl
done
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
T="env PYTHONPATH=/tmp/pinode:$PWD/tests PINPOOL_REQUIRE_PKEYS=1 python3 -m pytest -q -p no:cacheprovider"
timeout 120 $T tests/unit/test_windows.py tests/unit/test_reservations.py tests/faults/test_hardening.py -k "window or reservation or arena or ahead or planned or tagged or worked_out or plan" > $OUT/pkeys-tests.log 2>&1
echo "== keyed window tests: exit $?"; tail -1 $OUT/pkeys-tests.log; t
timeout 150 $T -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "== cuda tests: exit $?"; tail -1 $OUT/cuda-tests.log; t
for w in fix inode; do
  echo "== reservation cost, $w" >> $OUT/reservation-cost.txt
  PYTHONPATH=/tmp/p$w timeout 60 python3 benchmarks/reservation_cost.py >> $OUT/reservation-cost.txt 2>&1
  echo "== reservation cost $w: exit $?"; t
done
cat $OUT/reservation-cost.txt
B() { # name, wheels to alternate, how many rounds, then bench args
  local name=$1 wheels=$2 n=$3 i=0; shift 3
  for w in $(for i in $(seq $n); do echo $wheels; done); do
    i=$(( i + 1 ))
    PYTHONPATH=/tmp/p$w timeout 90 python3 -m pinpool.bench --out $OUT/r/$name-$w-$i "$@" >> $OUT/$name-$w.log 2>&1
    echo "== $name $w: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/$name-$w.log | tail -2; t
  done
}
B tok "fix inode" 3 --workloads tokens --modes throughput --repeats 3 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
cat $OUT/tok-*.log > $OUT/all.log; rm -f $OUT/tok-*.log
