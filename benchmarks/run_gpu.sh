#!/usr/bin/env bash
# pinpool's GPU checks and measurements, for a CUDA machine that has torch but no Rust
# toolchain: build the wheel (`make wheel`) and the criterion binary
# (`cargo bench --bench checkout --no-run`) elsewhere, bring both, then
#
#   benchmarks/run_gpu.sh WHEEL OUTDIR STAGE...     (run from the repository root)
#
# Stages: tests (every pytest test, CUDA ones included), cuda-tests (only those),
# pool (benchmarks/pool_bench.py), criterion BINARY (the checkout bench), bench ARGS...
# (python -m pinpool.bench with ARGS up to the next stage name).
set -uo pipefail
wheel=$1 out=$2
shift 2
mkdir -p "$out"
site=/tmp/pinpool-site
python3 -m pip install -q --no-deps --no-index --upgrade --target "$site" "$wheel" || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1
status=0
while [ $# -gt 0 ]; do
  stage=$1
  shift
  echo "== $stage"
  case $stage in
    tests) python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$out/tests.log" || status=1 ;;
    cuda-tests) python3 -m pytest -q -p no:cacheprovider -m cuda tests 2>&1 | tee "$out/cuda-tests.log" || status=1 ;;
    pool) python3 benchmarks/pool_bench.py --out "$out/pool.json" || status=1 ;;
    criterion)
      bin=$1
      shift
      "$bin" --bench 2>&1 | grep -v -E '^(Benchmarking|Found|  [0-9]+ \(|Warning)' | tee "$out/criterion.txt" || status=1
      ;;
    bench)
      args=()
      while [ $# -gt 0 ] && ! [[ $1 =~ ^(tests|cuda-tests|pool|criterion|bench)$ ]]; do
        args+=("$1")
        shift
      done
      python3 -m pinpool.bench "${args[@]}" || status=1
      ;;
    *) echo "unknown stage $stage" >&2; status=2 ;;
  esac
done
exit $status
