#!/usr/bin/env bash
# A/B of a kernel change in one call on the GPU machine: builds the CUDA library from the tree as it is (A) and
# from a copy of kernels/ with the files of $AB_DIR laid over it (B), then runs one command against each build,
# alternating A, B, A, B so that drift of the machine shows.
#   usage (repo root):  AB_DIR=ab AB_CMD="python3 scripts/probe_paged_prefill.py" bash scripts/gpu_ab.sh
# $AB_DIR mirrors kernels/ (e.g. ab/cuda/attention_sm90.cuh replaces kernels/cuda/attention_sm90.cuh); a variant
# kept on a branch can be put there with `git show BRANCH:kernels/cuda/X > ab/cuda/X`.
set -uo pipefail
PY=${PY:-python3}
AB_DIR=${AB_DIR:?AB_DIR: the folder of replacement kernel files}
AB_CMD=${AB_CMD:?AB_CMD: the command to run against each build}
ROUNDS=${ROUNDS:-2}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
build() {  # build SRC_DIR BUILD_DIR
  cmake -S "$1" -B "$2" -G Ninja -DPython_EXECUTABLE="$(command -v "$PY")" -DMSA_OPS_CUDA_ARCHS=90a \
    -DCMAKE_BUILD_TYPE=Release > "$2.log" 2>&1 && cmake --build "$2" -j 16 >> "$2.log" 2>&1 \
    || { tail -n 30 "$2.log"; return 1; }
}
rm -rf /tmp/ab_src && cp -r kernels /tmp/ab_src && cp -r "$AB_DIR"/. /tmp/ab_src/
build kernels /tmp/ab_build_a & pa=$!
build /tmp/ab_src /tmp/ab_build_b & pb=$!
wait $pa || exit 1
wait $pb || exit 1
for r in $(seq "$ROUNDS"); do
  for v in a b; do
    echo "=== round $r, build ${v^^}"
    MSA_OPS_LIBRARY_DIR=/tmp/ab_build_$v bash -c "$AB_CMD" 2>&1 | grep -v "Warning"
  done
done
