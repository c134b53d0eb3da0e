#!/usr/bin/env bash
# #27 item 4 on the H200, third call: tokens (throughput), "after" = 7b8ba4e (call2's) against
# "opt" = 52b82a9 (the reservation's common path kept lean, tagged indices pickled as plain
# tuples, the reservation size kept), alternating, three rounds; the stall scenario twice with
# "opt" against "before" = a85a3b3; py-spy --gil of device batches and of zero-copy with "opt".
set -u
mkdir -p $OUT/r
for w in before after opt; do
  python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl
done
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
B() { # name, wheels to alternate, how many rounds, then bench args
  local name=$1 wheels=$2 n=$3 i=0; shift 3
  for w in $(for i in $(seq $n); do echo $wheels; done); do
    i=$(( i + 1 ))
    PYTHONPATH=/tmp/p$w timeout 90 python3 -m pinpool.bench --out $OUT/r/$name-$w-$i "$@" >> $OUT/$name-$w.log 2>&1
    echo "== $name $w: exit $?"; grep -E "^  (GB/s|us per batch|next\(\) ms, median|end of epoch)|batches went" $OUT/$name-$w.log | tail -4; t
  done
}
B tok "after opt" 3 --workloads tokens --modes throughput --repeats 3 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy
B stall "before opt" 2 --workloads synthetic --modes stall --repeats 2 --loaders pinpool pinpool-zerocopy
python3 -m pip install -q --no-deps --no-index --target /tmp/spy .gpu/tools/py_spy-*.whl
for l in pinpool-device pinpool-zerocopy; do
  PYTHONPATH=/tmp/popt timeout 60 /tmp/spy/bin/py-spy record --gil --nonblocking -r 250 -f raw -o $OUT/r/spy-$l-gil.txt -- \
    python3 -m pinpool.bench --out $OUT/r/spy-$l-gil --workloads tokens --modes throughput --repeats 2 --loaders $l >> $OUT/spy.log 2>&1
  echo "== py-spy $l --gil: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/spy.log | tail -2; t
done
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
cat $OUT/*.log > $OUT/all.log
