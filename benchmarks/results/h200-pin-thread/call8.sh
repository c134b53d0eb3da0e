#!/usr/bin/env bash
# #27 item 4 on the H200, call 8: the tokens bench (10000 steps a run) with torch's pin thread
# (as shipped, wheel cur = 54745cc) and without it (without_pin_thread.py: the consumer's
# thread takes every batch), alternating, two rounds.
set -u
mkdir -p $OUT/r
python3 -m pip install -q --no-deps --no-index --target /tmp/pcur .gpu/cur/*.whl
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
H=benchmarks/results/h200-pin-thread
for i in 1 2; do
  for v in pin nopin; do
    if [ $v = pin ]; then run="-m pinpool.bench"; else run="$H/without_pin_thread.py"; fi
    PYTHONPATH=/tmp/pcur timeout 150 python3 $run --out $OUT/r/tok-$v-$i --workloads tokens --modes throughput --repeats 3 --token-steps 10000 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy >> $OUT/tok-$v.log 2>&1
    echo "== tok $v $i: exit $?"; grep -E "^  (GB/s|us per batch|CPU ms|end of epoch)" $OUT/tok-$v.log | tail -4; t
  done
done
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
