#!/usr/bin/env bash
# Zero-copy's one slow step in the tokens workload: which call holds it (next_profile's max column).
set -u
pip install -q --no-deps --no-index --target /tmp/site dist/final/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$(pwd); cd $OUT
for i in 1 2 3; do
  timeout 40 python3 $R/benchmarks/next_profile.py --workload tokens --loader pinpool-zerocopy --steps 3000 > zc-$i.txt 2>&1
done
timeout 40 python3 $R/benchmarks/next_profile.py --workload tokens --loader pinpool-zerocopy --device cuda --steps 3000 > zc-cuda.txt 2>&1
for f in zc-1 zc-2 zc-3 zc-cuda; do echo "== $f"; grep "next() median" $f.txt; awk 'NF>=7 && $(NF) ~ /^[0-9]+$/ && $(NF)+0 > 3000' $f.txt | head -14; done
