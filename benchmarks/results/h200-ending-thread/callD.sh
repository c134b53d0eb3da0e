#!/usr/bin/env bash
# #27: zero-copy loaders send batches of 1 MiB or less through copy mode ("small2", the
# working tree after d4f955c) against 2e6aa60 ("fin2"), alternating; varlen; CUDA tier.
set -u
mkdir -p $OUT
for w in fin2 small2; do python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl; done
start=$(date +%s)
PYTHONPATH=/tmp/psmall2 timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "cuda tests: exit $? in $(( $(date +%s) - start )) s"; tail -1 $OUT/cuda-tests.log
for w in small2 fin2 small2 fin2; do
  PYTHONPATH=/tmp/p$w timeout 100 python3 -m pinpool.bench --out $OUT/r/tok-$w --workloads tokens --modes throughput --repeats 2 \
    --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy > $OUT/tok-$w.log 2>&1
  echo "== tokens $w: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/tok-$w.log
done
for w in small2 fin2; do
  PYTHONPATH=/tmp/p$w timeout 150 python3 -m pinpool.bench --out $OUT/r/var-$w --workloads varlen --modes throughput --repeats 1 \
    --loaders torch-pinned pinpool pinpool-zerocopy > $OUT/var-$w.log 2>&1
  echo "== varlen $w: exit $?"; grep -E "^  GB/s|went through|fallback" $OUT/var-$w.log | head -4
done
