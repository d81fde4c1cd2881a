#!/usr/bin/env bash
# One call on the GPU machine (H200): build the native libraries against the jaxlib there, run the GPU
# tests, a compute-sanitizer memcheck pass, the demo and the benchmarks; logs and JSON into $OUT.
#   usage (repo root):  bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PY:-python3}
BUILD=${BUILD:-/tmp/msa_ops_build}
declare -A STATUS

STEPS=${STEPS:-all}  # comma list of: build info gpu cpu suite demo bench sanitizer
# GPU_K: a pytest -k expression for the gpu step; SANITIZE_K: the one for the sanitizer step; BENCH_GLOB: which benchmarks;
# BENCH_ARGS: arguments for each of them (gpu_gather_ceiling.py takes no --rounds: leave it out of BENCH_GLOB then).
# SANITIZE_TIMEOUT: the sanitizer step's limit in seconds (default 520: its selection takes ~235 s alone on an H100,
# over 400 beside the GPU tests).
want() { [[ "$STEPS" == all || ",$STEPS," == *",$1,"* ]]; }

step() {  # step NAME CMD...  (log to $OUT/NAME.log, remember the exit code)
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  STATUS[$name]="rc=$rc $((SECONDS - t0))s"
  tail -n 25 "$OUT/$name.log"
  return 0
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
want build && step build bash -c "cmake -S kernels -B $BUILD -G Ninja -DPython_EXECUTABLE=$(command -v $PY) \
  -DMSA_OPS_CUDA_ARCHS=90a -DCMAKE_BUILD_TYPE=Release && cmake --build $BUILD -j 16"
export MSA_OPS_LIBRARY_DIR=$BUILD
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
want info && step info $PY -m msa_ops info
# run_parts NAME LIMIT PYTEST_ARGS...: one pytest process (LIMIT seconds) per non-empty $OUT/NAME_<i>.args (its test
# files or ids, one a line), all at once with the common PYTEST_ARGS; then each part's failures and count, and the total.
# Each part gets an equal share of the CPU cores for NumPy's BLAS (the float64 oracle's products), OpenMP and the CPU
# handlers' pool, unless the caller set those counts: every process taking all the cores made three parts on 16
# cores take 3.3x the CPU time of capped ones and 1.4x their wall time (NOTES_mha v61).
run_parts() {
  local name=$1 limit=$2 f last rc=0 np=0 nf=0 args=() parts=(); shift 2
  for f in "$OUT/${name}"_*.args; do [ -s "$f" ] && parts+=("$f"); done
  # (GNU nproc prints OMP_NUM_THREADS or OMP_THREAD_LIMIT where set: a caller's OpenMP count is not the core count)
  local cores; cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
  local t=$(( cores / (${#parts[@]} > 0 ? ${#parts[@]} : 1) )); (( t >= 1 )) || t=1
  for f in "${parts[@]}"; do
    mapfile -t args < "$f"
    OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-$t} OMP_NUM_THREADS=${OMP_NUM_THREADS:-$t} \
      MKL_NUM_THREADS=${MKL_NUM_THREADS:-$t} MSA_OPS_NUM_THREADS=${MSA_OPS_NUM_THREADS:-$t} \
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$limit" $PY -m pytest -q -p no:cacheprovider "$@" "${args[@]}" \
      > "${f%.args}.part" 2>&1 &
  done
  wait
  for f in "$OUT/${name}"_*.part; do
    [ -e "$f" ] || continue
    last=$(tail -n 1 "$f")
    [[ $last =~ ^[0-9]+\ passed && ! $last =~ [0-9]+\ (failed|error) ]] || rc=1
    echo "== $f"; grep -E "^FAILED|^ERROR" "$f"; awk '/slowest .*durations/ {on = 1; next} on && (/^$/ || /^=/) {exit} on' "$f" | head -n 10; echo "$last"; echo
    np=$((np + $(grep -oE "[0-9]+ passed" <<< "$last" | awk '{s += $1} END {print s + 0}')))
    nf=$((nf + $(grep -oE "[0-9]+ (failed|errors?)" <<< "$last" | awk '{s += $1} END {print s + 0}')))
    rm -f "$f" "${f%.part}.args"
  done
  echo "all parts: $np passed, $nf failed or errors"
  return $rc
}
# gpu: `pytest -m gpu`, in one process, or with GPU_PROCS=N dealt over N processes on the one GPU (the large-pool
# tests, which need ~11 GiB free each, all in the first, so that no two run at once; the others in turn over all N,
# the first part taking its turn last); one log. GPU_EVERY=K keeps every K-th test of the collection (a quick
# sample; with GPU_PROCS unset, in one process).
gpu_tests() {
  local n=${GPU_PROCS:-1} every=${GPU_EVERY:-1} i=1 id ids=()
  if (( n <= 1 && every <= 1 )); then
    timeout 600 $PY -m pytest -m gpu -q -p no:cacheprovider --durations=30 tests ${GPU_K:+-k "$GPU_K"}
    return
  fi
  mapfile -t ids < <($PY -m pytest -m gpu -q -p no:cacheprovider --collect-only tests ${GPU_K:+-k "$GPU_K"} | grep '::' \
    | awk -v k="$every" 'k <= 1 || NR % k == 1')
  echo "${#ids[@]} tests over $n processes"
  rm -f "$OUT"/gpu_*.args
  for id in "${ids[@]}"; do
    if (( n <= 1 )) || [[ $id == *test_large_pool* ]]; then echo "$id" >> "$OUT/gpu_0.args"
    else echo "$id" >> "$OUT/gpu_$((i % n)).args"; i=$((i + 1)); fi
  done
  run_parts gpu "${GPU_TIMEOUT:-580}" -m gpu --durations=10
}
want gpu && step pytest_gpu gpu_tests
want cpu && step pytest_cpu_native timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_reference.py -k native -x
# suite: the tests CI runs (not -m gpu), here where the default backend is the GPU and the CUDA library is loaded, as a
# user's `pytest` on a GPU machine runs them: every test file but the GPU and large-pool ones, dealt largest first
# over SUITE_PROCS processes (default 4); one log.
suite() {
  local n=${SUITE_PROCS:-4} i=0 f
  rm -f "$OUT"/suite_*.args
  for f in $(ls -S tests/test_*.py | grep -vE '/test_(gpu|large_pool)\.py$'); do
    echo "$f" >> "$OUT/suite_$((i % n)).args"; i=$((i + 1))
  done
  run_parts suite "${SUITE_TIMEOUT:-300}" -m "not gpu" -rf
}
want suite && step suite suite
want demo && step demo timeout 300 $PY -m msa_ops demo
BENCHES=()
for b in ${BENCH_GLOB:-benchmarks/gpu_*.py}; do
  [ -e "$b" ] && want bench || continue
  n="bench_$(basename "$b" .py)"; BENCHES+=("$n")
  step "$n" timeout 400 $PY "$b" --out "$OUT" ${BENCH_ARGS:-}
done
SANITIZE_K=${SANITIZE_K:-"store and 0-prefill or row_offsets or bad_values or padded_paged or ws_prefill_many \
or many_sequences and wgmma_ws or many_sequences and wgmma_pair or item_order or head_dim_256_other \
or 8_row_tiles_bad_pages or fetch_past_2_31 or later_tokens_nan"}
want sanitizer && step sanitizer timeout "${SANITIZE_TIMEOUT:-520}" compute-sanitizer --tool memcheck --error-exitcode 7 $PY -m pytest -m gpu -q \
  -p no:cacheprovider tests/test_gpu.py -k "$SANITIZE_K"
# Direct FFI calls with buffers out of contract, each buffer its own allocation so that an access past one shows.
want sanitizer && XLA_PYTHON_CLIENT_ALLOCATOR=platform step sanitizer_ffi timeout 300 compute-sanitizer --tool memcheck \
  --error-exitcode 7 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_raw_ffi_checks.py

echo
echo "| step | result |"
echo "| --- | --- |"
for k in build info pytest_gpu pytest_cpu_native suite demo "${BENCHES[@]}" sanitizer sanitizer_ffi; do
  echo "| $k | ${STATUS[$k]:-skipped} | $(grep -E 'passed|failed|ERROR SUMMARY|result:' "$OUT/$k.log" 2>/dev/null | tail -n 1) |"
done
for f in "$OUT"/*.md; do [ -e "$f" ] && cat "$f"; done
# More than 8 files in $OUT go into one archive, easier to copy back (PACK=0 keeps the files loose), e.g.
# `tar xf gpu_check.tar -C benchmarks/results gpu_mha.json gpu_mha.md` afterwards. Files the
# caller has in $OUT by then go in too and leave $OUT, this script's own redirected output among them: a command
# that reads it afterwards should redirect it outside $OUT, or pass PACK=0.
n=$(find "$OUT" -maxdepth 1 -type f | wc -l)
if [ "${PACK:-1}" != 0 ] && [ "$n" -gt 8 ]; then
  (cd "$OUT" && tar cf gpu_check.tar --exclude=gpu_check.tar -- * && find . -maxdepth 1 -type f ! -name gpu_check.tar -delete)
  echo "($n files of $OUT packed into gpu_check.tar)"
fi
