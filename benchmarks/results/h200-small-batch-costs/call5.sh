#!/usr/bin/env bash
# #27 items 3 and 4 on the H200, fifth call, wheel gil (a5313de; the checkout's tests and
# benchmarks of the commit after it): the CUDA tests (the deterministic send_then_release
# test included); benchmarks/consumer_path.py (each step of the consumer's and the pin
# thread's path, wall and thread CPU, by mode, switch interval 5 and 0.5 ms, prefetch 2 and
# 4); then the tokens bench with 10000 steps a run (five times the default), three rounds.
set -u
mkdir -p $OUT/r
python3 -m pip install -q --no-deps --no-index --target /tmp/pgil .gpu/gil/*.whl
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
timeout 200 env PYTHONPATH=/tmp/pgil:$PWD/tests python3 -m pytest -q -p no:cacheprovider -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "== cuda tests (gil): exit $?"; tail -n 1 $OUT/cuda-tests.log; grep -E "send_then|FAIL" $OUT/cuda-tests.log | head -5; t
PYTHONPATH=/tmp/pgil timeout 240 python3 benchmarks/consumer_path.py --rounds 2 --out $OUT/r/path.json > $OUT/path.log 2>&1
echo "== consumer_path: exit $?"; sed -n '/^tokens/,/^-- steps/p' $OUT/path.log; t
for i in 1 2 3; do
  PYTHONPATH=/tmp/pgil timeout 150 python3 -m pinpool.bench --out $OUT/r/tok10k-$i --workloads tokens --modes throughput --repeats 3 --token-steps 10000 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy >> $OUT/tok10k.log 2>&1
  echo "== tok10k $i: exit $?"; grep -E "^  (GB/s|us per batch|CPU ms)" $OUT/tok10k.log | tail -3; t
done
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
