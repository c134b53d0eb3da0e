#!/usr/bin/env bash
# #27 item 3 on the H200: "after" = bce3269 (a fresh worker's hinted windows mapped unfaulted while
# it holds its first slot's descriptor, faulted in by a thread of its own under each window's key)
# against "before" = a85a3b3 (the code of e8427e6), alternating. Correctness first: the keyed
# window, reservation and arena-reach tests (the reach test three times: it looks for a race),
# then the CUDA tests, then the stall scenario three rounds, 38.5 MB x 2 and 8 workers, tokens.
set -u
mkdir -p $OUT
for w in before after; do
  python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl
done
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
T="env PYTHONPATH=/tmp/pafter:$PWD/tests PINPOOL_REQUIRE_PKEYS=1 python3 -m pytest -q -p no:cacheprovider"
timeout 120 $T tests/unit/test_windows.py tests/unit/test_reservations.py tests/faults/test_hardening.py -k "window or reservation or arena or ahead or planned" > $OUT/pkeys-tests.log 2>&1
echo "== keyed window tests: exit $?"; tail -1 $OUT/pkeys-tests.log; t
for i in 1 2; do
  timeout 90 $T tests/faults/test_hardening.py -k reaches_no_arena >> $OUT/reach-tests.log 2>&1
  echo "== reach test again ($i): exit $?"; tail -1 $OUT/reach-tests.log; t
done
timeout 150 $T -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "== cuda tests: exit $?"; tail -1 $OUT/cuda-tests.log; t
B() { # name, how many rounds of (before, after), then bench args
  local name=$1 n=$2 i=0; shift 2
  for w in $(for i in $(seq $n); do echo before after; done); do
    i=$(( i + 1 ))
    PYTHONPATH=/tmp/p$w timeout 60 python3 -m pinpool.bench --out $OUT/r/$name-$w-$i "$@" >> $OUT/$name-$w.log 2>&1
    echo "== $name $w: exit $?"; grep -E "^  (GB/s|us per batch|next\(\) ms, median|end of epoch)|batches went" $OUT/$name-$w.log | tail -4; t
  done
}
B stall 3 --workloads synthetic --modes stall --repeats 2 --loaders pinpool pinpool-zerocopy
B syn2 1 --workloads synthetic --modes throughput --workers 2 --repeats 2 --loaders pinpool pinpool-device pinpool-zerocopy
B syn8 1 --workloads synthetic --modes throughput --workers 8 --repeats 1 --loaders pinpool pinpool-device pinpool-zerocopy
B tokens 1 --workloads tokens --repeats 3
PYTHONPATH=/tmp/pafter timeout 100 python3 benchmarks/fresh_workers.py --out /tmp/fresh > $OUT/fresh-workers.txt 2>&1
echo "== fresh workers: exit $?"; tail -25 $OUT/fresh-workers.txt; t
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
