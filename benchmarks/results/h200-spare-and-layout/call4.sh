#!/usr/bin/env bash
# #27 items 3 and 4 on the H200, fourth call: small = f0f340c (in zero-copy mode, batches for
# the device of at most 1 MiB get no reservation and come through copy mode) against
# fix = 0fe8739. The CUDA tests with small; tokens (throughput) three rounds, fix and small
# alternating; benchmarks/next_profile.py on tokens, zero-copy, with small.
set -u
mkdir -p $OUT/r
for w in fix small; do
  python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl
done
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
T="env PYTHONPATH=/tmp/psmall:$PWD/tests PINPOOL_REQUIRE_PKEYS=1 python3 -m pytest -q -p no:cacheprovider"
timeout 150 $T -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "== cuda tests: exit $?"; tail -1 $OUT/cuda-tests.log; t
B() { # name, wheels to alternate, how many rounds, then bench args
  local name=$1 wheels=$2 n=$3 i=0; shift 3
  for w in $(for i in $(seq $n); do echo $wheels; done); do
    i=$(( i + 1 ))
    PYTHONPATH=/tmp/p$w timeout 90 python3 -m pinpool.bench --out $OUT/r/$name-$w-$i "$@" >> $OUT/$name-$w.log 2>&1
    echo "== $name $w: exit $?"; grep -E "^  (GB/s|us per batch|next\(\) ms, median)|batches went" $OUT/$name-$w.log | tail -4; t
  done
}
B tok "fix small" 3 --workloads tokens --modes throughput --repeats 3 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy
PYTHONPATH=/tmp/psmall timeout 90 python3 benchmarks/next_profile.py --workload tokens --loader pinpool-zerocopy --device cuda --steps 4000 > $OUT/next-profile.txt 2>&1
echo "== next_profile zero-copy: exit $?"; grep "us/batch" $OUT/next-profile.txt | tail -1; t
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
cat $OUT/tok-*.log > $OUT/all.log; rm -f $OUT/tok-*.log
