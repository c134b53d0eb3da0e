#!/usr/bin/env bash
# #27 item 3 on the H200: tick = d579e1d (small zero-copy batches get their slot from the index
# queue's writer thread, in Rust without the GIL) against inode = c559749 (the reservation on
# the consumer's thread). The keyed and CUDA tests with tick; next_profile.py of tokens, both
# modes, with each wheel; tokens (throughput) four rounds, inode and tick alternating.
set -u
mkdir -p $OUT/r
for w in inode tick; do
  python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl
done
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
T="env PYTHONPATH=/tmp/ptick:$PWD/tests PINPOOL_REQUIRE_PKEYS=1 python3 -m pytest -q -p no:cacheprovider"
timeout 120 $T tests/unit/test_windows.py tests/unit/test_reservations.py tests/faults/test_hardening.py -k "window or reservation or arena or ahead or planned or tagged or worked_out or plan or ticket or writer" > $OUT/pkeys-tests.log 2>&1
echo "== keyed window tests: exit $?"; tail -1 $OUT/pkeys-tests.log; t
timeout 150 $T -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "== cuda tests: exit $?"; tail -1 $OUT/cuda-tests.log; t
for w in inode tick; do
  for l in pinpool pinpool-zerocopy; do
    echo "== next_profile $w $l" >> $OUT/next-profile.txt
    PYTHONPATH=/tmp/p$w timeout 60 python3 benchmarks/next_profile.py --workload tokens --loader $l --device cuda --steps 4000 >> $OUT/next-profile.txt 2>&1
    echo "== profile $w $l: exit $?"; t
  done
done
grep -E "^== next|^pinpool|index.put|slot.reserve|MainThread|_pin_memory_loop" $OUT/next-profile.txt
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
