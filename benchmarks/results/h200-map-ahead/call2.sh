#!/usr/bin/env bash
# #27 item 3 on the H200, second call: the 268 MB x 2 workers stall scenario, "after" =
# 8301756 (hinted slots offered after a worker's own, counted as its windows only once
# it had them) against "before" = a85a3b3, alternating, three rounds; then tokens again.
set -u
mkdir -p $OUT
for w in before after; do
  python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl
done
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
B() { # name, how many rounds of (before, after), then bench args
  local name=$1 n=$2 i=0; shift 2
  for w in $(for i in $(seq $n); do echo before after; done); do
    i=$(( i + 1 ))
    PYTHONPATH=/tmp/p$w timeout 60 python3 -m pinpool.bench --out $OUT/r/$name-$w-$i "$@" >> $OUT/$name-$w.log 2>&1
    echo "== $name $w: exit $?"; grep -E "^  (GB/s|us per batch|next\(\) ms, median|end of epoch)|batches went" $OUT/$name-$w.log | tail -4; t
  done
}
B stall 3 --workloads synthetic --modes stall --repeats 2 --loaders pinpool pinpool-zerocopy
B tok 2 --workloads tokens --modes throughput --repeats 3 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
