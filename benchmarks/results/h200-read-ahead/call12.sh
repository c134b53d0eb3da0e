#!/usr/bin/env bash
# #27 items 3 and 4 on the H200, call 12: the read-ahead's wheel (f2c5a2e, "intake") alone, the
# tokens bench three times over (10000 steps a run, 3 repeats): zero-copy against the copy
# modes, with more runs than calls 9 and 10 gave.
set -u
mkdir -p $OUT/r
python3 -m pip install -q --no-deps --no-index --target /tmp/pintake .gpu/intake/*.whl
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
for i in 1 2 3; do
  PYTHONPATH=/tmp/pintake timeout 150 python3 -m pinpool.bench --out $OUT/r/tok-intake-$i --workloads tokens --modes throughput --repeats 3 --token-steps 10000 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy >> $OUT/tok-intake.log 2>&1
  echo "== tok intake $i: exit $?"; grep -E "^  (GB/s|us per batch|CPU ms)" $OUT/tok-intake.log | tail -3; t
done
for f in $OUT/r/*/table.txt; do d=$(basename $(dirname $f)); cp $f $OUT/$d.table.txt; done
rm -rf $OUT/r
