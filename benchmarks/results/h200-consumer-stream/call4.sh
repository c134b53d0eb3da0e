#!/usr/bin/env bash
# #27: the final commit's CUDA tier and tokens / 38.5 MB zero-copy figures.
set -u
mkdir -p $OUT
python3 -m pip install -q --no-deps --no-index --target /tmp/pf .gpu/final/*.whl
export PYTHONPATH=/tmp/pf
start=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "cuda tests: exit $? in $(( $(date +%s) - start )) s"; tail -2 $OUT/cuda-tests.log
timeout 100 python3 -m pinpool.bench --out $OUT/r/tok --workloads tokens --modes throughput --repeats 2 \
  --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy > $OUT/tok.log 2>&1
echo "== tokens: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/tok.log
timeout 100 python3 -m pinpool.bench --out $OUT/r/syn2 --workloads synthetic --modes throughput --workers 2 \
  --repeats 2 --loaders pinpool pinpool-device pinpool-zerocopy > $OUT/syn-2.log 2>&1
echo "== synthetic 2 workers: exit $?"; grep -E "^  (GB/s|end of epoch)|batches went" $OUT/syn-2.log
