#!/usr/bin/env bash
# #27: big zero-copy windows opened and closed on the worker's window thread (3e3b8ee, "wt")
# against the commit before (95b4e44, "b95"), back to back on one lend.
set -u
mkdir -p $OUT
for w in b95 wt; do python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/$w/*.whl; done
D=benchmarks/results/h200-window-thread
t() { echo "   [$(( $(date +%s) - start )) s]"; }
start=$(date +%s)
PYTHONPATH=/tmp/pwt timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "cuda tests: exit $?"; tail -1 $OUT/cuda-tests.log; t
for w in b95 wt b95 wt; do
  PYTHONPATH=/tmp/p$w timeout 100 python3 -m pinpool.bench --out $OUT/r/stall-$w --workloads synthetic --modes stall \
    --repeats 2 --loaders pinpool pinpool-zerocopy >> $OUT/stall-$w.log 2>&1
  echo "== stall 268 MB x 2 workers, $w: exit $?"; grep -E "^  (GB/s|next\(\) ms, median)|batches went" $OUT/stall-$w.log | tail -3; t
done
for w in b95 wt; do
  PYTHONPATH=/tmp/p$w timeout 100 python3 -m pinpool.bench --out $OUT/r/syn2-$w --workloads synthetic --modes throughput \
    --workers 2 --repeats 2 --loaders pinpool pinpool-device pinpool-zerocopy > $OUT/syn2-$w.log 2>&1
  echo "== synthetic 38.5 MB x 2 workers, $w: exit $?"; grep -E "^  GB/s|batches went" $OUT/syn2-$w.log; t
done
for n in 8 14; do
  PYTHONPATH=/tmp/pwt timeout 100 python3 -m pinpool.bench --out $OUT/r/syn$n --workloads synthetic --modes throughput \
    --workers $n --repeats 2 --loaders pinpool pinpool-device pinpool-zerocopy > $OUT/syn$n-wt.log 2>&1
  echo "== synthetic 38.5 MB x $n workers, wt: exit $?"; grep -E "^  GB/s|batches went" $OUT/syn$n-wt.log; t
done
for w in wt b95; do
  PYTHONPATH=/tmp/p$w timeout 100 python3 $D/zcprobe.py --to-cuda --parts > $OUT/zc268-$w.log 2>&1
  echo "== zcprobe 268 MB x 2, to cuda, parts, $w: exit $?"; grep -E "^==|part\.|place" $OUT/zc268-$w.log; t
done
PYTHONPATH=/tmp/pwt timeout 120 python3 -m pinpool.bench --out $OUT/r/tok --workloads tokens --modes throughput --repeats 3 \
  --loaders torch-pinned pinpool pinpool-device pinpool-zerocopy > $OUT/tok-wt.log 2>&1
echo "== tokens wt: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/tok-wt.log; t
