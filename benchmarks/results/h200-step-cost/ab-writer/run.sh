#!/usr/bin/env bash
# A/B: a = f61754a, b = Rust index writer + kept pickler + record_stream ahead + zero-copy via Slot.copy_to_device
set -u
for v in a b; do pip install -q --no-deps --no-index --target /tmp/site-$v dist/$v/*.whl >/dev/null 2>&1; done
export PYTHONUNBUFFERED=1
R=$(pwd); cd $OUT
(cd $R; PYTHONPATH=/tmp/site-b timeout 200 python3 -m pytest -q -x tests/test_cuda.py tests/test_loader_cuda.py tests/test_batch_path.py tests/test_segments.py > $OUT/gpu-tests-b.log 2>&1); tail -1 gpu-tests-b.log
L="torch-pinned pinpool pinpool-device pinpool-zerocopy"
for r in 1 2; do for v in a b; do
  echo "== gap $v $r" >> gap.txt
  PYTHONPATH=/tmp/site-$v timeout 80 python3 $R/scratch/gap.py --loaders $L --probe >> gap.txt 2>&1
done; done
for v in a b; do
  PYTHONPATH=/tmp/site-$v timeout 60 python3 -m pinpool.bench --workload tokens --modes throughput --repeats 1 --loaders $L --out tok-$v > tok-$v.log 2>&1
done
for d in none cuda; do
  D=""; [ $d = cuda ] && D="--device cuda"
  PYTHONPATH=/tmp/site-b timeout 40 python3 $R/benchmarks/next_profile.py --workload synthetic --shape 3 224 224 --batch-size 256 --workers 8 --step-ms 30 --loader pinpool $D --steps 300 > prof30-b-$d.txt 2>&1
done
PYTHONPATH=/tmp/site-b timeout 20 python3 $R/scratch/putparts.py > putparts.txt 2>&1
rm -rf tok-a tok-b
grep -E "^==|^torch|^pinpool" gap.txt
for v in a b; do echo "tok $v"; grep -E "GB/s  |next\(\) ms, median" tok-$v.log; done
for d in none cuda; do head -1 prof30-b-$d.txt; grep " main " prof30-b-$d.txt; done
cat putparts.txt
