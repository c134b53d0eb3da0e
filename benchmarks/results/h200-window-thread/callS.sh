#!/usr/bin/env bash
# #27 item 4: where the main process's threads hold the GIL per token batch, device batches
# in copy mode against zero-copy (cb158f3's wheel, "fin3"), sampled by py-spy (--gil).
set -u
mkdir -p $OUT
python3 -m pip install -q --no-deps --no-index --target /tmp/pfin3 .gpu/fin3/*.whl
D=benchmarks/results/h200-window-thread
i=0
for m in copy zc copy zc; do
  i=$((i + 1))
  PYTHONPATH=/tmp/pfin3 timeout 100 .gpu/spy/py-spy record --gil -r 1000 -f raw -o $OUT/spy-$i-$m.txt \
    -- python3 $D/tokspy.py $m 2>&1 | grep -E "us/batch|Samples|rror" | tail -3
done
