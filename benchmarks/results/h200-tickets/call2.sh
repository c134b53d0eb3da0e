#!/usr/bin/env bash
# #27 items 3 and 4 on the H200, second call: tick = d579e1d against inode = c559749 again. The
# keyed tests with tick (the new test fixed in 9382cfa to compare (inode, offset)); tokens
# (throughput) four more rounds, inode and tick alternating.
set -u
mkdir -p $OUT/r
for w in inode tick; do
  python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl
done
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
T="env PYTHONPATH=/tmp/ptick:$PWD/tests PINPOOL_REQUIRE_PKEYS=1 python3 -m pytest -q -p no:cacheprovider"
timeout 120 $T tests/unit/test_windows.py tests/unit/test_reservations.py tests/faults/test_hardening.py -k "window or reservation or arena or ahead or planned or tagged or worked_out or plan or ticket or writer" > $OUT/pkeys-tests.log 2>&1
echo "== keyed window tests: exit $?"; tail -n 1 $OUT/pkeys-tests.log; t
B() { # name, wheels to alternate, how many rounds, then bench args
  local name=$1 wheels=$2 n=$3 i=0; shift 3
  for w in $(for i in $(seq $n); do echo $wheels; done); do
    i=$(( i + 1 ))
    PYTHONPATH=/tmp/p$w timeout 90 python3 -m pinpool.bench --out $OUT/r/$name-$w-$i "$@" >> $OUT/$name-$w.log 2>&1
    echo "== $name $w: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/$name-$w.log | tail -2; t
  done
}
B tok "inode tick" 4 --workloads tokens --modes throughput --repeats 3 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
cat $OUT/tok-*.log > $OUT/all.log; rm -f $OUT/tok-*.log
