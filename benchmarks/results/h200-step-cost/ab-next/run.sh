#!/usr/bin/env bash
# A/B: b = Rust index writer etc. (run32), c = b + no record_function per batch + pool hint
set -u
for v in a b c; do pip install -q --no-deps --no-index --target /tmp/site-$v dist/$v/*.whl >/dev/null 2>&1; done
export PYTHONUNBUFFERED=1
R=$(pwd); cd $OUT
(cd $R; PYTHONPATH=/tmp/site-c timeout 200 python3 -m pytest -q -x tests/test_cuda.py tests/test_loader_cuda.py tests/test_batch_path.py tests/test_segments.py tests/test_pool_hint.py > $OUT/gpu-tests-c.log 2>&1); tail -1 gpu-tests-c.log
L="torch-pinned pinpool pinpool-device pinpool-zerocopy"
for r in 1 2; do for v in b c; do
  echo "== gap $v $r" >> gap.txt
  PYTHONPATH=/tmp/site-$v timeout 80 python3 $R/scratch/gap.py --loaders $L --probe >> gap.txt 2>&1
done; done
for v in a c; do
  echo "== ttfb $v" >> ttfb.txt
  PYTHONPATH=/tmp/site-$v timeout 60 python3 $R/scratch/ttfb.py --rounds 3 >> ttfb.txt 2>&1
done
PYTHONPATH=/tmp/site-c timeout 40 python3 $R/benchmarks/next_profile.py --workload synthetic --shape 3 224 224 --batch-size 256 --workers 8 --step-ms 30 --loader pinpool --device cuda --steps 300 > prof30-c-cuda.txt 2>&1
grep -E "^==|^torch|^pinpool" gap.txt
cat ttfb.txt
head -1 prof30-c-cuda.txt; grep " main " prof30-c-cuda.txt
