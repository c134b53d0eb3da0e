#!/usr/bin/env bash
# #27 item 4 (and 3 on tokens) on the H200, second call, new = a28e261 (and opt = 52b82a9):
# what a device batch's leaves cost the consumer's thread, one view per leaf against the
# device layout (benchmarks/device_views.py); where the time per batch goes on tokens, device
# batches in copy mode against zero-copy, each twice, alternating (benchmarks/next_profile.py);
# then tokens (throughput) two more rounds, opt and new alternating.
set -u
mkdir -p $OUT/r
for w in opt new; do
  python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl
done
start=$(date +%s)
t() { echo "   [$(( $(date +%s) - start )) s]"; }
PYTHONPATH=/tmp/pnew timeout 120 python3 benchmarks/device_views.py > $OUT/device-views.txt 2>&1
echo "== device views: exit $?"; cat $OUT/device-views.txt; t
for i in 1 2; do
  for l in pinpool pinpool-zerocopy; do
    PYTHONPATH=/tmp/pnew timeout 90 python3 benchmarks/next_profile.py --workload tokens --loader $l --device cuda --steps 4000 >> $OUT/next-profile.txt 2>&1
    echo "== next_profile $l: exit $?"; grep "us/batch" $OUT/next-profile.txt | tail -1; t
  done
done
B() { # name, wheels to alternate, how many rounds, then bench args
  local name=$1 wheels=$2 n=$3 i=0; shift 3
  for w in $(for i in $(seq $n); do echo $wheels; done); do
    i=$(( i + 1 ))
    PYTHONPATH=/tmp/p$w timeout 90 python3 -m pinpool.bench --out $OUT/r/$name-$w-$i "$@" >> $OUT/$name-$w.log 2>&1
    echo "== $name $w: exit $?"; grep -E "^  (GB/s|us per batch|next\(\) ms, median)" $OUT/$name-$w.log | tail -3; t
  done
}
B tok "opt new" 2 --workloads tokens --modes throughput --repeats 3 --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy
find $OUT/r -name "*.png" -delete; tar czf $OUT/runs.tgz -C $OUT r && rm -rf $OUT/r
cat $OUT/tok-*.log > $OUT/all.log; rm -f $OUT/tok-*.log
