#!/usr/bin/env bash
# #27: the final commit: end of epoch (ending thread, the finalizer not waiting), windows kept
# by size and per iterator; against 67609aa where it matters.
set -u
mkdir -p $OUT
for w in base fin; do python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl; done
start=$(date +%s)
PYTHONPATH=/tmp/pfin timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "cuda tests: exit $? in $(( $(date +%s) - start )) s"; tail -1 $OUT/cuda-tests.log
for w in fin base; do
  PYTHONPATH=/tmp/p$w timeout 100 python3 -m pinpool.bench --out $OUT/r/tok-$w --workloads tokens --modes throughput --repeats 2 \
    --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy > $OUT/tok-$w.log 2>&1
  echo "== tokens $w: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/tok-$w.log
done
PYTHONPATH=/tmp/pfin timeout 150 python3 -m pinpool.bench --out $OUT/r/stall --workloads synthetic --modes stall --repeats 2 \
  --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy > $OUT/stall.log 2>&1
echo "== stall 268 MB fin: exit $?"; grep -E "^  (GB/s|end of epoch|next\(\) ms, median)|batches went|^    del" $OUT/stall.log
for n in 2 8; do
  PYTHONPATH=/tmp/pfin timeout 100 python3 -m pinpool.bench --out $OUT/r/syn$n --workloads synthetic --modes throughput --workers $n \
    --repeats 2 --loaders pinpool pinpool-device pinpool-zerocopy > $OUT/syn-$n.log 2>&1
  echo "== synthetic $n workers fin: exit $?"; grep -E "^  (GB/s|end of epoch)|batches went" $OUT/syn-$n.log
done
PYTHONPATH=/tmp/pfin timeout 100 python3 .gpu/zcprobe.py --to-cuda > $OUT/zc-268.log 2>&1
echo "== zcprobe 268 MB x 2, to cuda: exit $?"; grep -E "^==|worker|batch.wait|slot.reserve" $OUT/zc-268.log
PYTHONPATH=/tmp/pfin timeout 100 python3 .gpu/zcprobe.py --workload tokens --shape 8193 --batch 8 --workers 4 --batches 1500 --epochs 1 --modes zero-copy > $OUT/zc-tok.log 2>&1
echo "== zcprobe tokens: exit $?"; grep -E "^==|worker|index.put" $OUT/zc-tok.log
PYTHONPATH=/tmp/pfin timeout 120 python3 benchmarks/end_of_epoch.py --epochs 3 --rounds 1 --variants "torch pinned" pinpool "pinpool device" "pinpool zero-copy" > $OUT/eoe-fin.log 2>&1
echo "== end of epoch 38.5 MB x 8 fin: exit $?"; grep final $OUT/eoe-fin.log
