#!/usr/bin/env bash
# pinpool's GPU checks and measurements, for a CUDA machine that has torch but no Rust
# toolchain: build the wheel (`make wheel`) and the criterion binary
# (`cargo bench --bench checkout --no-run`) elsewhere, bring both, then
#
#   benchmarks/run_gpu.sh WHEEL OUTDIR STAGE...     (run from the repository root)
#
# Stages: tests (every pytest test, CUDA ones included), zero-copy-tests (the DataLoader
# suite again with zero_copy=True as its default), cuda-tests (only the CUDA tests), torch-suite
# FILE (a copy of torch's test_dataloader.py with torch's loader and pinpool's, at once:
# tests/torch_suite/run.py), keep-last (the soak's keep-last case, 20 runs per mode: a
# consumer keeping its last 4 batches never sends one to ordinary memory), pool (benchmarks/pool_bench.py), criterion BINARY (the checkout
# bench), bench ARGS... (python -m pinpool.bench with ARGS up to the next stage name).
set -uo pipefail
wheel=$1 out=$2
shift 2
mkdir -p "$out"
site=/tmp/pinpool-site
python3 -m pip install -q --no-deps --no-index --upgrade --target "$site" "$wheel" || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1
status=0
# A hung test must not eat the whole run: give each one a limit when pytest-timeout is there.
pytest=(python3 -m pytest -q -rfE --durations=8 -p no:cacheprovider)
if python3 -c 'import pytest_timeout' 2>/dev/null; then pytest+=(--timeout 180); fi
while [ $# -gt 0 ]; do
  stage=$1
  shift
  echo "== $stage"
  case $stage in
    tests) "${pytest[@]}" tests >"$out/tests.log" 2>&1 || status=1; tail -n 40 "$out/tests.log" ;;
    zero-copy-tests)
      "${pytest[@]}" --zero-copy tests/loader/test_loader.py tests/faults/test_loader_faults.py \
        tests/gpu/test_loader_cuda.py \
        >"$out/zero-copy-tests.log" 2>&1 || status=1
      tail -n 40 "$out/zero-copy-tests.log"
      ;;
    cuda-tests) "${pytest[@]}" -m cuda tests >"$out/cuda-tests.log" 2>&1 || status=1; tail -n 25 "$out/cuda-tests.log" ;;
    torch-suite)
      file=$1
      shift
      python3 tests/torch_suite/run.py "$file" "$out/torch-suite" -n 7 --timeout 150 -rfE 2>&1 \
        | tee "$out/torch-suite.txt" | tail -n 30 || status=1
      ;;
    keep-last)
      PINPOOL_KEEP_LAST_RUNS=20 "${pytest[@]}" tests/soak/test_soak.py -k keeping_its_last \
        >"$out/keep-last.log" 2>&1 || status=1
      tail -n 5 "$out/keep-last.log"
      ;;
    pool) python3 benchmarks/pool_bench.py --out "$out/pool.json" || status=1 ;;
    criterion)
      bin=$1
      shift
      "$bin" --bench 2>&1 | grep -v -E '^(Benchmarking|Found|  [0-9]+ \(|Warning)' | tee "$out/criterion.txt" || status=1
      ;;
    bench)
      args=()
      while [ $# -gt 0 ] && ! [[ $1 =~ ^(tests|zero-copy-tests|cuda-tests|torch-suite|keep-last|pool|criterion|bench)$ ]]; do
        args+=("$1")
        shift
      done
      python3 -m pinpool.bench "${args[@]}" || status=1
      ;;
    *) echo "unknown stage $stage" >&2; status=2 ;;
  esac
done
exit $status
