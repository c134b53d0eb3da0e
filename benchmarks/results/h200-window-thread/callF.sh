#!/usr/bin/env bash
# #27, the commit that takes the window thread out again (cb158f3, "fin3"): the CUDA tier, the
# windows' tests, and 95b4e44 ("b95") against it, back to back.
set -u
mkdir -p $OUT
for w in b95 fin3; do python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl; done
t() { echo "   [$(( $(date +%s) - start )) s]"; }
start=$(date +%s)
PYTHONPATH=/tmp/pfin3 timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "cuda tests: exit $?"; tail -1 $OUT/cuda-tests.log; t
PYTHONPATH=/tmp/pfin3 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/unit/test_windows.py \
  tests/faults/test_hardening.py -k "window or reservation or arena" > $OUT/windows-tests.log 2>&1
echo "windows tests: exit $?"; tail -1 $OUT/windows-tests.log; t
for w in b95 fin3 b95 fin3; do
  PYTHONPATH=/tmp/p$w timeout 100 python3 -m pinpool.bench --out $OUT/r/syn2-$w --workloads synthetic --modes throughput \
    --workers 2 --repeats 2 --loaders pinpool pinpool-device pinpool-zerocopy >> $OUT/syn2-$w.log 2>&1
  echo "== synthetic 38.5 MB x 2 workers, $w: exit $?"; grep -E "^  GB/s|batches went" $OUT/syn2-$w.log | tail -2; t
done
for w in b95 fin3; do
  PYTHONPATH=/tmp/p$w timeout 120 python3 -m pinpool.bench --out $OUT/r/tok-$w --workloads tokens --modes throughput \
    --repeats 2 --loaders pinpool pinpool-device pinpool-zerocopy > $OUT/tok-$w.log 2>&1
  echo "== tokens $w: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/tok-$w.log; t
done
rm -rf $OUT/r
