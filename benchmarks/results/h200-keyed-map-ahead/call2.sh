#!/usr/bin/env bash
# #27 items 3 and 4 on the H200, second call: "after" = 7b8ba4e (call1's bce3269, and a slot
# remembered for a later worker only for big batches) against "before" = a85a3b3, alternating:
# the stall scenario three more rounds, tokens (throughput) two rounds, 38.5 MB x 14 workers once;
# then py-spy (carried as a wheel) on the main process of a tokens run of copy mode and of
# zero-copy with the after wheel, all samples and those holding the GIL (--gil).
set -u
mkdir -p $OUT/r
for w in before after; do
  python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl
done
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
B() { # name, how many rounds of (before, after), then bench args
  local name=$1 n=$2 i=0; shift 2
  for w in $(for i in $(seq $n); do echo before after; done); do
    i=$(( i + 1 ))
    PYTHONPATH=/tmp/p$w timeout 90 python3 -m pinpool.bench --out $OUT/r/$name-$w-$i "$@" >> $OUT/$name-$w.log 2>&1
    echo "== $name $w: exit $?"; grep -E "^  (GB/s|us per batch|next\(\) ms, median|end of epoch)|batches went" $OUT/$name-$w.log | tail -4; t
  done
}
B stall 3 --workloads synthetic --modes stall --repeats 2 --loaders pinpool pinpool-zerocopy
B tok 2 --workloads tokens --modes throughput --repeats 3 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy
B syn14 1 --workloads synthetic --modes throughput --workers 14 --repeats 1 --loaders pinpool pinpool-device pinpool-zerocopy
python3 -m pip install -q --no-deps --no-index --target /tmp/spy .gpu/tools/py_spy-*.whl
for l in pinpool pinpool-zerocopy; do
  for g in "" --gil; do
    PYTHONPATH=/tmp/pafter timeout 60 /tmp/spy/bin/py-spy record $g -r 400 -f raw -o $OUT/r/spy-$l${g:+-gil}.txt -- \
      python3 -m pinpool.bench --out $OUT/r/spy-$l${g:+-gil} --workloads tokens --modes throughput --repeats 2 --loaders $l >> $OUT/spy.log 2>&1
    echo "== py-spy $l $g: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/spy.log | tail -2; t
  done
done
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
cat $OUT/*.log > $OUT/all.log
