#!/usr/bin/env bash
# a vs e again: tokens, device batches only, 4 alternating rounds; then every GPU test of e.
set -u
for v in a e; do pip install -q --no-deps --no-index --target /tmp/site-$v dist/$v/*.whl >/dev/null 2>&1; done
export PYTHONUNBUFFERED=1
R=$(pwd); cd $OUT
for round in 1 2 3 4; do for v in a e; do
  PYTHONPATH=/tmp/site-$v timeout 40 python3 -m pinpool.bench --workload tokens --modes throughput --repeats 1 --loaders pinpool-device --out tok-$v-$round > tok-$v-$round.log 2>&1
  rm -rf tok-$v-$round
  echo "$v $round $(grep -E '^  GB/s' tok-$v-$round.log)" >> tok-summary.txt
done; done
cd $R; PYTHONPATH=/tmp/site-e timeout 200 python3 -m pytest -q tests/test_cuda.py tests/test_loader_cuda.py tests/test_batch_path.py tests/test_segments.py tests/test_pool.py tests/test_release.py > $OUT/gpu-tests-e.log 2>&1; cd $OUT
cat tok-summary.txt; tail -1 gpu-tests-e.log; grep FAILED gpu-tests-e.log | head
mkdir -p logs; mv tok-*.log logs/; tar czf logs.tgz logs; rm -rf logs
