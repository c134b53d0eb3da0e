#!/usr/bin/env bash
# #27 item 4 on the H200, call 9: the consumer's read-ahead (wheel "intake") against the shipped
# pin-thread path (wheel cur = 54745cc): the CUDA tests on the new wheel, then the tokens
# bench (10000 steps a run), alternating, two rounds.
set -u
mkdir -p $OUT/r
for w in cur intake; do python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl; done
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
PYTHONPATH=/tmp/pintake:$PWD/tests timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests -x > $OUT/cuda-tests.log 2>&1
echo "== cuda tests: exit $?"; tail -3 $OUT/cuda-tests.log; grep -E "^(FAILED|ERROR)" $OUT/cuda-tests.log | head; t
for i in 1 2; do
  for w in cur intake; do
    PYTHONPATH=/tmp/p$w timeout 150 python3 -m pinpool.bench --out $OUT/r/tok-$w-$i --workloads tokens --modes throughput --repeats 3 --token-steps 10000 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy >> $OUT/tok-$w.log 2>&1
    echo "== tok $w $i: exit $?"; grep -E "^  (GB/s|us per batch|CPU ms|end of epoch)" $OUT/tok-$w.log | tail -4; t
  done
done
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
