#!/usr/bin/env bash
# Issue 13's checks on a machine with two GPUs (torch, no Rust toolchain): the wheel built
# elsewhere is installed, then, from the repository root,
#
#   benchmarks/run_ranks.sh WHEEL OUTDIR STAGE...
#
# Stages: topology (GPUs, CPU layout), tests (the data-parallel and device-choice tests),
# train (the user guide's torchrun snippet on 2 ranks), bench RANKS ARGS...
# (python -m pinpool.bench --ranks RANKS ARGS, into OUTDIR/ranksRANKS).
set -uo pipefail
wheel=$1 out=$2
shift 2
mkdir -p "$out"
site=/tmp/pinpool-site
python3 -m pip install -q --no-deps --no-index --upgrade --target "$site" "$wheel" 2>/dev/null || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1
status=0
while [ $# -gt 0 ]; do
  stage=$1
  shift
  echo "== $stage"
  case $stage in
    topology)
      { nvidia-smi -L; nvidia-smi topo -m
        lscpu | grep -E '^(CPU\(s\)|Model name|Thread|Core)'; } >"$out/topology.txt" 2>&1
      cat "$out/topology.txt"
      ;;
    tests)
      python3 -m pytest -q -rfE -s -p no:cacheprovider tests/frameworks/test_distributed.py \
        tests/gpu/test_cuda.py tests/unit/test_pool.py \
        >"$out/tests.log" 2>&1 || status=1
      grep -E "passed|failed|FAILED|arena" "$out/tests.log" | tail -n 20
      ;;
    train)
      # The first python block under the user guide's data-parallel heading, as a file.
      python3 - >/tmp/train_ddp.py <<'PY'
import re
text = open("docs/guide.md").read()
part = text[text.index("## Data-parallel: one rank per GPU"):]
print(re.search(r"```python\n(.*?)```", part, re.S).group(1))
PY
      python3 -m torch.distributed.run --standalone --nproc-per-node=2 /tmp/train_ddp.py \
        >"$out/train.log" 2>&1 || status=1
      tail -n 6 "$out/train.log"
      ;;
    bench)
      ranks=$1
      shift
      args=()
      while [ $# -gt 0 ] && ! [[ $1 =~ ^(topology|tests|train|bench)$ ]]; do
        args+=("$1")
        shift
      done
      python3 -m pinpool.bench --ranks "$ranks" "${args[@]}" --out "$out/ranks$ranks" \
        >"$out/ranks$ranks.log" 2>&1 || status=1
      sed -n '/^synthetic\/throughput/,$p' "$out/ranks$ranks.log" | grep -E "^[a-z0-9]|GB/s |GPU idle|probe late ms, max|^    " | head -n 40
      ;;
    *) echo "unknown stage $stage" >&2; status=2 ;;
  esac
done
exit $status
