#!/usr/bin/env bash
# #27 items 3 and 4 on the H200, third call: fix = 0fe8739 (a checkout that prefers extents
# takes a free one without retiring fences first) against new = a28e261. The CUDA tests with
# fix; tokens (throughput) three rounds and the stall scenario two, new and fix alternating;
# benchmarks/next_profile.py on tokens with fix, device batches in copy mode and zero-copy.
set -u
mkdir -p $OUT/r
for w in new fix; do
  python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl
done
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
T="env PYTHONPATH=/tmp/pfix:$PWD/tests PINPOOL_REQUIRE_PKEYS=1 python3 -m pytest -q -p no:cacheprovider"
timeout 150 $T -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "== cuda tests: exit $?"; tail -1 $OUT/cuda-tests.log; t
B() { # name, wheels to alternate, how many rounds, then bench args
  local name=$1 wheels=$2 n=$3 i=0; shift 3
  for w in $(for i in $(seq $n); do echo $wheels; done); do
    i=$(( i + 1 ))
    PYTHONPATH=/tmp/p$w timeout 90 python3 -m pinpool.bench --out $OUT/r/$name-$w-$i "$@" >> $OUT/$name-$w.log 2>&1
    echo "== $name $w: exit $?"; grep -E "^  (GB/s|us per batch|next\(\) ms, median)" $OUT/$name-$w.log | tail -3; t
  done
}
B tok "new fix" 3 --workloads tokens --modes throughput --repeats 3 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy
B stall "new fix" 2 --workloads synthetic --modes stall --repeats 2 --loaders pinpool pinpool-zerocopy
for l in pinpool pinpool-zerocopy; do
  PYTHONPATH=/tmp/pfix timeout 90 python3 benchmarks/next_profile.py --workload tokens --loader $l --device cuda --steps 4000 >> $OUT/next-profile.txt 2>&1
  echo "== next_profile $l: exit $?"; grep "us/batch" $OUT/next-profile.txt | tail -1; t
done
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
cat $OUT/tok-*.log $OUT/stall-*.log > $OUT/all.log; rm -f $OUT/tok-*.log $OUT/stall-*.log
