#!/usr/bin/env bash
# #27 items 3 and 4 on the H200: a fresh zero-copy worker maps its predecessor's slots ahead
# ("after" = 0c2738a) against the commit before it ("before" = a85a3b3: the same code as
# 403a7ec), both wheels built with `make wheel`, back to back and alternating on one lend.
set -u
mkdir -p $OUT
for w in before after; do
  python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl
done
PYTHONPATH=/tmp/pafter python3 -c "import pinpool._native as n; print('after has keys:', hasattr(n.ArenaWindow, 'allow'))"
PYTHONPATH=/tmp/pbefore python3 -c "import pinpool._native as n; print('before has keys:', hasattr(n.ArenaWindow, 'allow'))"
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
B() { # name, how many rounds of (before, after), then bench args
  local name=$1 n=$2; shift 2
  for w in $(for i in $(seq $n); do echo before after; done); do
    PYTHONPATH=/tmp/p$w timeout 60 python3 -m pinpool.bench --out $OUT/r/$name-$w "$@" >> $OUT/$name-$w.log 2>&1
    echo "== $name $w: exit $?"; grep -E "^  (GB/s|us per batch|next\(\) ms, median|end of epoch)|batches went" $OUT/$name-$w.log | tail -4; t
  done
}
B stall 2 --workloads synthetic --modes stall --repeats 2 --loaders pinpool pinpool-zerocopy
B syn2 2 --workloads synthetic --modes throughput --workers 2 --repeats 2 --loaders pinpool pinpool-device pinpool-zerocopy
B tok 2 --workloads tokens --modes throughput --repeats 3 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy
B syn8 1 --workloads synthetic --modes throughput --workers 8 --repeats 1 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy
B syn14 1 --workloads synthetic --modes throughput --workers 14 --repeats 1 --loaders pinpool pinpool-device pinpool-zerocopy
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
PYTHONPATH=/tmp/pafter:$PWD/tests PINPOOL_REQUIRE_PKEYS=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "== cuda tests: exit $?"; tail -1 $OUT/cuda-tests.log; t
PYTHONPATH=/tmp/pafter:$PWD/tests PINPOOL_REQUIRE_PKEYS=1 timeout 90 python3 -m pytest -q -p no:cacheprovider tests/unit/test_windows.py tests/unit/test_reservations.py tests/faults/test_hardening.py -k "window or reservation or arena or ahead" > $OUT/pkeys-tests.log 2>&1
echo "== keyed window tests: exit $?"; tail -1 $OUT/pkeys-tests.log; t
