#!/usr/bin/env bash
# Diagnostics at f61754a: the compute scenario's per-step gap, next() by function with 30 ms steps, TTFB.
set -u
pip install -q --no-deps --no-index --target /tmp/site dist/a/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$(pwd); cd $OUT
L="torch-pinned pinpool pinpool-device pinpool-zerocopy"
timeout 100 python3 $R/scratch/gap.py --loaders $L --probe > gap-probe.txt 2>&1
timeout 100 python3 $R/scratch/gap.py --loaders $L > gap-noprobe.txt 2>&1
timeout 60 python3 $R/scratch/gap.py --loaders pinpool-device pinpool --probe --switch 0.0005 > gap-switch.txt 2>&1
for d in none cuda; do
  D=""; [ $d = cuda ] && D="--device cuda"
  timeout 40 python3 $R/benchmarks/next_profile.py --workload synthetic --shape 3 224 224 --batch-size 256 --workers 8 --step-ms 30 --loader pinpool $D --steps 400 > prof30-$d.txt 2>&1
done
timeout 40 python3 $R/benchmarks/next_profile.py --workload synthetic --shape 3 224 224 --batch-size 256 --workers 8 --step-ms 30 --loader torch-pinned --steps 400 > prof30-torch.txt 2>&1
timeout 60 python3 $R/scratch/ttfb.py --rounds 2 > ttfb-fork.txt 2>&1
timeout 60 python3 $R/scratch/ttfb.py --rounds 2 --start-method forkserver > ttfb-forkserver.txt 2>&1
cat gap-probe.txt gap-noprobe.txt gap-switch.txt ttfb-fork.txt ttfb-forkserver.txt
for d in none cuda torch; do head -25 prof30-$d.txt | cut -c1-90; done
