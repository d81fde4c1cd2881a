#!/usr/bin/env bash
# The benchmarks alone on the GPU machine, each with its own arguments and time limit, after building the library
# (a no-op where scripts/gpu_check.sh built it in a call that left the machine warm). Each benchmark's JSON,
# markdown and log go into $OUT/all.tar as soon as it ends, so a call cut short still returns what finished.
#   usage (repo root):  bash scripts/gpu_bench.sh "gpu_mha.py --only decode --rounds 2:150" "gpu_msa.py:120" ...
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
STEPS=build PACK=0 OUT="$OUT/build" bash scripts/gpu_check.sh > "$OUT/build.out" 2>&1
grep -E '^\| build' "$OUT/build.out"
export MSA_OPS_LIBRARY_DIR=${BUILD:-/tmp/msa_ops_build} PYTHONPATH=$PWD PYTHONUNBUFFERED=1
tar cf "$OUT/all.tar" -C "$OUT" build.out build && rm -rf "$OUT/build.out" "$OUT/build"
for spec in "$@"; do
  cmd=${spec%:*} limit=${spec##*:}
  n=$(echo "$cmd" | tr -c 'A-Za-z0-9\n' '_')
  echo "=== $cmd (limit ${limit}s)"
  t0=$SECONDS
  timeout "$limit" python3 benchmarks/$cmd --out "$OUT/$n" > "$OUT/$n.log" 2>&1
  echo "rc=$? $((SECONDS - t0))s"
  cat "$OUT/$n"/*.md 2>/dev/null || tail -n 15 "$OUT/$n.log"
  tar rf "$OUT/all.tar" -C "$OUT" "$n" "$n.log" 2>/dev/null; rm -rf "${OUT:?}/$n" "$OUT/$n.log"
done
