#!/usr/bin/env bash
# a: HEAD (5eb005b); b: batch indices written to the workers' pipes by the sending thread (no feeder threads).
set -u
for v in a b; do pip install -q --no-deps --no-index --target /tmp/site-$v dist/$v/*.whl >/dev/null 2>&1; done
export PYTHONUNBUFFERED=1
R=$(pwd); cd $OUT
L="torch-pinned pinpool pinpool-device pinpool-zerocopy"
for round in 1 2; do for v in a b; do
  S=$(date +%s)
  PYTHONPATH=/tmp/site-$v timeout 90 python3 -m pinpool.bench --workload tokens --modes throughput --repeats 1 --loaders $L --out tok-$v-$round > tok-$v-$round.log 2>&1
  M=$(date +%s)
  PYTHONPATH=/tmp/site-$v timeout 90 python3 -m pinpool.bench --workload synthetic --modes compute --repeats 1 --loaders $L --out cmp-$v-$round > cmp-$v-$round.log 2>&1
  echo "$v $round tok $((M-S)) s, cmp $(( $(date +%s)-M )) s" >> times.txt
  rm -rf tok-$v-$round cmp-$v-$round
done; done
for d in none cuda; do
  D=""; [ $d = cuda ] && D="--device cuda"
  PYTHONPATH=/tmp/site-b timeout 60 python3 $R/benchmarks/next_profile.py --workload tokens --loader pinpool $D --steps 3000 > prof-b-$d.txt 2>&1
done
cat times.txt
for round in 1 2; do for v in a b; do echo "== $v $round"; grep -E "GB/s  |us per batch" tok-$v-$round.log | tail -2; grep -E "GPU idle|next\(\) ms" cmp-$v-$round.log | tail -3; done; done
for d in none cuda; do head -1 prof-b-$d.txt; grep -A9 "CPU time per batch" prof-b-$d.txt; done
