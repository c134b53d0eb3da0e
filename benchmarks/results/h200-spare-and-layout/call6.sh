#!/usr/bin/env bash
# #27 on the H200, sixth call (the command as run): benchmarks/reservation_cost.py with the
# inode wheel (c559749; the script's drain of fenced slots is in the next commit, unused here:
# no round found every slot fenced).
python3 -m pip install -q --no-deps --no-index --target /tmp/pi .gpu/inode/*.whl && PYTHONPATH=/tmp/pi timeout 100 python3 benchmarks/reservation_cost.py 2>&1 | tee $OUT/reservation-cost.txt
