#!/usr/bin/env bash
# #27 items 3 and 4 on the H200, seventh call: turn = 594ff27 (a small zero-copy batch for the device
# adopted and sent on the consumer's thread in its turn) against gil = a5313de. CUDA tests with
# turn; benchmarks/consumer_path.py with turn (switch 5 ms, prefetch 2, two rounds); the
# tokens bench with 10000 steps a run, the two wheels alternating, two rounds each.
set -u
mkdir -p $OUT/r
for w in gil turn; do
  python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl
done
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
timeout 200 env PYTHONPATH=/tmp/pturn:$PWD/tests python3 -m pytest -q -p no:cacheprovider -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "== cuda tests (turn): exit $?"; tail -n 1 $OUT/cuda-tests.log; grep -E "FAIL|Error" $OUT/cuda-tests.log | head -8; t
PYTHONPATH=/tmp/pturn timeout 120 python3 benchmarks/consumer_path.py --rounds 2 --switch-ms 5 --prefetch 2 --out $OUT/r/path-turn.json > $OUT/path-turn.log 2>&1
echo "== consumer_path turn: exit $?"; sed -n '/^tokens/,/^-- steps/p' $OUT/path-turn.log; grep -E "^(device|zero-copy)|allocate|send_in_turn|   wait" $OUT/path-turn.log; t
for i in 1 2; do
  for w in gil turn; do
    PYTHONPATH=/tmp/p$w timeout 150 python3 -m pinpool.bench --out $OUT/r/tok10k-$w-$i --workloads tokens --modes throughput --repeats 3 --token-steps 10000 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy >> $OUT/tok10k-$w.log 2>&1
    echo "== tok10k $w $i: exit $?"; grep -E "^  (GB/s|us per batch|CPU ms)" $OUT/tok10k-$w.log | tail -3; t
  done
done
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
