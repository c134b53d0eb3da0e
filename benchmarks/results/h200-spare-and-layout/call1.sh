#!/usr/bin/env bash
# #27 items 3 and 4 on the H200, first call: new = a28e261 (a spare place planned after a fresh
# worker's own four; device batches of one dtype in one allocation, viewed in one native call)
# against opt = 52b82a9 (the last stop's final code). The keyed and CUDA tests with new; then,
# alternating opt and new: the stall scenario (268 MB x 2 workers) three rounds, tokens two;
# with new alone, copy mode against zero-copy at 38.5 MB x 2, 8 and 14 workers, and the trace
# of fresh workers' first batches (benchmarks/fresh_workers.py).
set -u
mkdir -p $OUT/r
for w in opt new; do
  python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl
done
(lscpu | grep -iE "^(model name|numa|socket|core|thread)"; cat /sys/kernel/mm/transparent_hugepage/shmem_enabled) > $OUT/machine.txt 2>&1
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
T="env PYTHONPATH=/tmp/pnew:$PWD/tests PINPOOL_REQUIRE_PKEYS=1 python3 -m pytest -q -p no:cacheprovider"
timeout 120 $T tests/unit/test_windows.py tests/unit/test_reservations.py tests/faults/test_hardening.py -k "window or reservation or arena or ahead or planned or tagged or worked_out or plan" > $OUT/pkeys-tests.log 2>&1
echo "== keyed window tests: exit $?"; tail -1 $OUT/pkeys-tests.log; t
timeout 150 $T -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "== cuda tests: exit $?"; tail -1 $OUT/cuda-tests.log; t
B() { # name, wheels to alternate, how many rounds, then bench args
  local name=$1 wheels=$2 n=$3 i=0; shift 3
  for w in $(for i in $(seq $n); do echo $wheels; done); do
    i=$(( i + 1 ))
    PYTHONPATH=/tmp/p$w timeout 90 python3 -m pinpool.bench --out $OUT/r/$name-$w-$i "$@" >> $OUT/$name-$w.log 2>&1
    echo "== $name $w: exit $?"; grep -E "^  (GB/s|us per batch|next\(\) ms, median)" $OUT/$name-$w.log | tail -2; t
  done
}
B stall "opt new" 3 --workloads synthetic --modes stall --repeats 2 --loaders pinpool pinpool-zerocopy
B tok "opt new" 2 --workloads tokens --modes throughput --repeats 3 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy
for n in 2 8 14; do
  B syn$n new 1 --workloads synthetic --modes throughput --workers $n --repeats 2 --loaders pinpool pinpool-zerocopy
done
PYTHONPATH=/tmp/pnew timeout 120 python3 benchmarks/fresh_workers.py --out $OUT/r/fresh > $OUT/fresh-workers.txt 2>&1
echo "== fresh workers: exit $?"; t
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
cat $OUT/*.log > $OUT/all.log; rm -f $OUT/stall-*.log $OUT/tok-*.log $OUT/syn*.log
