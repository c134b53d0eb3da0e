#!/usr/bin/env bash
# #27: the ending thread (end of epoch) against 67609aa; where zero-copy's time goes.
set -u
mkdir -p $OUT
for w in base end; do python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl; done
V=("torch pinned" pinpool "pinpool device" "pinpool zero-copy")
for w in end base; do
  PYTHONPATH=/tmp/p$w timeout 150 python3 benchmarks/end_of_epoch.py --epochs 3 --rounds 2 --variants "${V[@]}" > $OUT/eoe-$w.log 2>&1
  echo "== end of epoch, 38.5 MB x 8, $w: exit $?"; grep -v Warn $OUT/eoe-$w.log | grep "final"
done
PYTHONPATH=/tmp/pend timeout 150 python3 benchmarks/end_of_epoch.py --epochs 3 --rounds 1 --workers 2 --batch-size 1786 --variants "${V[@]}" > $OUT/eoe-268-end.log 2>&1
echo "== end of epoch, 268 MB x 2, end: exit $?"; grep "final" $OUT/eoe-268-end.log
PYTHONPATH=/tmp/pend timeout 150 python3 -m pinpool.bench --out $OUT/r/stall --workloads synthetic --modes stall --repeats 2 \
  --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy > $OUT/stall.log 2>&1
echo "== stall 268 MB: exit $?"; grep -E "^  (GB/s|end of epoch|time to first|next\(\) ms, median)|batches went" $OUT/stall.log
PYTHONPATH=/tmp/pend timeout 100 python3 .gpu/zcprobe.py > $OUT/zc-268.log 2>&1
echo "== zcprobe 268 MB x 2: exit $?"; cat $OUT/zc-268.log
PYTHONPATH=/tmp/pend timeout 100 python3 .gpu/zcprobe.py --workload tokens --shape 8193 --batch 8 --workers 4 --batches 1500 --epochs 1 > $OUT/zc-tok.log 2>&1
echo "== zcprobe tokens: exit $?"; cat $OUT/zc-tok.log
start=$(date +%s)
PYTHONPATH=/tmp/pend timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "cuda tests: exit $? in $(( $(date +%s) - start )) s"; tail -2 $OUT/cuda-tests.log
