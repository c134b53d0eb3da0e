#!/usr/bin/env bash
# #27: the commit with the exit wait (2e6aa60): CUDA tier, end of epoch, tokens x3, the stall
# scenario as is and with a longer warm-up (zero-copy's steady state), a worker's parts.
set -u
mkdir -p $OUT
python3 -m pip install -q --no-deps --no-index --target /tmp/pf .gpu/fin2/*.whl
export PYTHONPATH=/tmp/pf
start=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "cuda tests: exit $? in $(( $(date +%s) - start )) s"; tail -1 $OUT/cuda-tests.log
timeout 150 python3 benchmarks/end_of_epoch.py --epochs 3 --rounds 2 --variants "torch pinned" pinpool "pinpool device" "pinpool zero-copy" > $OUT/eoe.log 2>&1
echo "== end of epoch 38.5 MB x 8: exit $?"; grep final $OUT/eoe.log
timeout 120 python3 -m pinpool.bench --out $OUT/r/tok --workloads tokens --modes throughput --repeats 3 \
  --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy > $OUT/tok.log 2>&1
echo "== tokens x3: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/tok.log
timeout 150 python3 -m pinpool.bench --out $OUT/r/stall --workloads synthetic --modes stall --repeats 2 \
  --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy > $OUT/stall.log 2>&1
echo "== stall 268 MB: exit $?"; grep -E "^  (GB/s|end of epoch|next\(\) ms, median)|batches went|^    (epoch|del)" $OUT/stall.log
timeout 150 python3 -m pinpool.bench --out $OUT/r/stallw --workloads synthetic --modes stall --repeats 2 --warmup 30 \
  --loaders pinpool pinpool-zerocopy > $OUT/stall-warm30.log 2>&1
echo "== stall 268 MB, warm-up 30: exit $?"; grep -E "^  (GB/s|next\(\) ms, median)|batches went|^    epoch" $OUT/stall-warm30.log
timeout 100 python3 .gpu/zcprobe.py --to-cuda --parts > $OUT/zc-268.log 2>&1
echo "== zcprobe 268 MB x 2, to cuda, parts: exit $?"; grep -E "^==|worker" $OUT/zc-268.log
