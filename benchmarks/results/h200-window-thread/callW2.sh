#!/usr/bin/env bash
# #27, after callW and callN (whose "wt" wheel carried the previous native module): 95b4e44
# ("b95"), the window thread (3e3b8ee, "wt", rebuilt) and the same with windows left writable
# while kept ("np": noprot.py), back to back on one lend.
set -u
mkdir -p $OUT
D=benchmarks/results/h200-window-thread
python3 -m pip install -q --no-deps --no-index --target /tmp/pb95 .gpu/b95/*.whl
for w in wt np; do python3 -m pip install -q --no-deps --no-index --target /tmp/p$w .gpu/wt/*.whl; done
python3 $D/noprot.py /tmp/pnp
python3 -c "import sys; sys.path.insert(0, '/tmp/pwt'); import pinpool._native as n; print('open_range' in dir(n.ArenaWindow))"
t() { echo "   [$(( $(date +%s) - start )) s]"; }
start=$(date +%s)
PYTHONPATH=/tmp/pwt timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests > $OUT/cuda-tests.log 2>&1
echo "cuda tests: exit $?"; tail -1 $OUT/cuda-tests.log; t
for w in b95 wt np b95 wt np; do
  PYTHONPATH=/tmp/p$w timeout 100 python3 -m pinpool.bench --out $OUT/r/stall-$w --workloads synthetic --modes stall \
    --repeats 2 --loaders pinpool pinpool-zerocopy >> $OUT/stall-$w.log 2>&1
  echo "== stall 268 MB x 2 workers, $w: exit $?"; grep -E "^  (GB/s|next\(\) ms, median)|batches went" $OUT/stall-$w.log | tail -3; t
done
for w in b95 wt np; do
  PYTHONPATH=/tmp/p$w timeout 100 python3 -m pinpool.bench --out $OUT/r/syn2-$w --workloads synthetic --modes throughput \
    --workers 2 --repeats 2 --loaders pinpool pinpool-device pinpool-zerocopy > $OUT/syn2-$w.log 2>&1
  echo "== synthetic 38.5 MB x 2 workers, $w: exit $?"; grep -E "^  GB/s|batches went" $OUT/syn2-$w.log; t
done
for w in wt np; do
  PYTHONPATH=/tmp/p$w timeout 100 python3 $D/zcprobe.py --to-cuda --parts > $OUT/zc268-$w.log 2>&1
  echo "== zcprobe 268 MB x 2, to cuda, parts, $w: exit $?"; grep -E "^==|part\.|place" $OUT/zc268-$w.log; t
done
for w in wt np; do
  PYTHONPATH=/tmp/p$w timeout 120 python3 -m pinpool.bench --out $OUT/r/tok-$w --workloads tokens --modes throughput \
    --repeats 2 --loaders pinpool pinpool-device pinpool-zerocopy > $OUT/tok-$w.log 2>&1
  echo "== tokens $w: exit $?"; grep -E "^  (GB/s|us per batch)" $OUT/tok-$w.log; t
done
rm -rf $OUT/r
