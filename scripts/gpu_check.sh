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
STEPS=${STEPS:-all}  # comma list of: build info gpu cpu demo bench sanitizer
# GPU_K: a pytest -k expression for the gpu step; SANITIZE_K: the one for the sanitizer step; BENCH_GLOB: which benchmarks;
# BENCH_ARGS: arguments for each of them (gpu_gather_ceiling.py takes no --rounds: leave it out of BENCH_GLOB then).
# SHARDS=N (N > 1): the gpu step's tests split over N pytest processes that run at once, beside the two sanitizer
# steps, each process taking GPU memory as it needs it; the oracles' CPU time is most of the step. The benchmarks
# run after all of them, alone on the GPU.
want() { [[ "$STEPS" == all || ",$STEPS," == *",$1,"* ]]; }

step() {  # step NAME CMD...  (log to $OUT/NAME.log, the exit code and seconds to $OUT/NAME.status)
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "rc=$rc $((SECONDS - t0))s" > "$OUT/$name.status"
  tail -n 25 "$OUT/$name.log"
  return 0
}
SHARDS=${SHARDS:-1}
gpu_tests() {  # the gpu step: one pytest process, or SHARDS of them, each taking every SHARDS-th collected test
  if [ "$SHARDS" -le 1 ]; then
    timeout 600 $PY -m pytest -m gpu -q -p no:cacheprovider tests ${GPU_K:+-k "$GPU_K"}
    return
  fi
  $PY -m pytest -m gpu --collect-only -q -p no:cacheprovider tests ${GPU_K:+-k "$GPU_K"} | grep '::' > "$OUT/gpu_tests.txt"
  echo "$(wc -l < "$OUT/gpu_tests.txt") tests in $SHARDS processes"
  local i rc=0 pids=()
  for ((i = 0; i < SHARDS; i++)); do
    awk -v n="$SHARDS" -v i="$i" 'NR % n == i' "$OUT/gpu_tests.txt" > "$OUT/gpu_tests_$i.txt"
    timeout 600 xargs -d '\n' -a "$OUT/gpu_tests_$i.txt" $PY -m pytest -m gpu -q -p no:cacheprovider \
      > "$OUT/pytest_gpu_$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || rc=1
    echo "shard $i: $(grep -E 'passed|failed|error|skipped' "$OUT/pytest_gpu_$i.log" | tail -n 1)"
    grep -E '^(FAILED|ERROR) ' "$OUT/pytest_gpu_$i.log"
  done
  local sum='{s += $1} END {print s + 0}'
  echo "result: $(grep -ohE '[0-9]+ passed' "$OUT"/pytest_gpu_*.log | awk "$sum") passed, \
$(grep -ohE '[0-9]+ (failed|errors?)' "$OUT"/pytest_gpu_*.log | awk "$sum") failed or errors in $SHARDS processes"
  return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
want build && step build bash -c "cmake -S kernels -B $BUILD -G Ninja -DPython_EXECUTABLE=$(command -v $PY) \
  -DMSA_OPS_CUDA_ARCHS=90a -DCMAKE_BUILD_TYPE=Release && cmake --build $BUILD -j 16"
export MSA_OPS_LIBRARY_DIR=$BUILD
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
want info && step info $PY -m msa_ops info
SANITIZE_K=${SANITIZE_K:-"store and 0-prefill or row_offsets or bad_values or padded_paged or ws_prefill_many \
or many_sequences and wgmma_ws or many_sequences and wgmma_pair or item_order or head_dim_256_other"}
sanitizers() {
  want sanitizer && step sanitizer timeout 400 compute-sanitizer --tool memcheck --error-exitcode 7 $PY -m pytest -m gpu \
    -q -p no:cacheprovider tests/test_gpu.py -k "$SANITIZE_K"
  # Direct FFI calls with buffers out of contract, each buffer its own allocation so that an access past one shows.
  want sanitizer && XLA_PYTHON_CLIENT_ALLOCATOR=platform step sanitizer_ffi timeout 300 compute-sanitizer \
    --tool memcheck --error-exitcode 7 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_raw_ffi_checks.py
}
if [ "$SHARDS" -gt 1 ]; then
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  sanitizers > "$OUT/sanitizers.out" 2>&1 &
  san_pid=$!
  want gpu && step pytest_gpu gpu_tests
  wait $san_pid; cat "$OUT/sanitizers.out"
  unset XLA_PYTHON_CLIENT_PREALLOCATE
else
  want gpu && step pytest_gpu gpu_tests
fi
want cpu && step pytest_cpu_native timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_reference.py -k native -x
want demo && step demo timeout 300 $PY -m msa_ops demo
BENCHES=()
for b in ${BENCH_GLOB:-benchmarks/gpu_*.py}; do
  [ -e "$b" ] && want bench || continue
  n="bench_$(basename "$b" .py)"; BENCHES+=("$n")
  step "$n" timeout 400 $PY "$b" --out "$OUT" ${BENCH_ARGS:-}
done
[ "$SHARDS" -le 1 ] && sanitizers

echo
echo "| step | result |"
echo "| --- | --- |"
for k in build info pytest_gpu pytest_cpu_native demo "${BENCHES[@]}" sanitizer sanitizer_ffi; do
  echo "| $k | $(cat "$OUT/$k.status" 2>/dev/null || echo skipped) | $(grep -E 'passed|failed|ERROR SUMMARY|result:' "$OUT/$k.log" 2>/dev/null | tail -n 1) |"
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
