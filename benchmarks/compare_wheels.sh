#!/usr/bin/env bash
# The same benchmark with two builds of pinpool, back to back on one machine: the way a change
# is shown to cost nothing (a GPU machine with torch and no Rust toolchain: build both wheels
# elsewhere with `make wheel`, from the two commits, and bring them).
#
#   benchmarks/compare_wheels.sh BEFORE.whl AFTER.whl OUTDIR [SECONDS] -- BENCH ARGS...
#
# Each wheel is installed into a folder of its own and `python -m pinpool.bench BENCH ARGS`
# runs with it, writing OUTDIR/before and OUTDIR/after (each stopped after SECONDS, default
# 290, so that both fit in one sitting); the two tables are printed last.
set -uo pipefail
before=$1 after=$2 out=$3
shift 3
limit=290
if [ $# -gt 0 ] && [ "$1" != "--" ]; then
  limit=$1
  shift
fi
[ "${1:-}" = "--" ] && shift
mkdir -p "$out"
status=0
for which in before after; do
  wheel=$before
  [ $which = after ] && wheel=$after
  site=/tmp/pinpool-$which
  rm -rf "$site"
  python3 -m pip install -q --no-deps --no-index --target "$site" "$wheel" || exit 1
  start=$(date +%s)
  PYTHONPATH=$site PYTHONUNBUFFERED=1 timeout "$limit" \
    python3 -m pinpool.bench --out "$out/$which" "$@" >"$out/$which.log" 2>&1 || status=1
  echo "== $which: $(($(date +%s) - start)) s, exit $status" | tee -a "$out/$which.log"
done
for which in before after; do
  echo "==================== $which"
  sed -n '/^[a-z]*\/[a-z]*:/,$p' "$out/$which.log" | grep -v '^  note' | head -n 80
done
exit $status
