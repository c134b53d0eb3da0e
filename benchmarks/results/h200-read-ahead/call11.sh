#!/usr/bin/env bash
# #27 item 4 on the H200, call 11: big batches go on through torch's pin thread (started by
# pinpool at the first one): synthetic 38.5 MB batches, 8 workers, throughput and stall, wheel
# intake against cur (54745cc), alternating.
set -u
mkdir -p $OUT/r
for w in cur intake; do python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl; done
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
for w in cur intake; do
  PYTHONPATH=/tmp/p$w timeout 250 python3 -m pinpool.bench --out $OUT/r/syn-$w --workloads synthetic --modes throughput stall --repeats 2 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy >> $OUT/syn-$w.log 2>&1
  echo "== syn $w: exit $?"; grep -E "^  (GB/s|next\(\) ms, median|probe late ms, max|end of epoch)" $OUT/syn-$w.log | tail -8; t
done
for f in $OUT/r/*/table.txt; do d=$(basename $(dirname $f)); cp $f $OUT/$d.table.txt; done
rm -rf $OUT/r
