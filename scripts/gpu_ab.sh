#!/usr/bin/env bash
# A/B of kernel changes in one call on the GPU machine: builds the CUDA library from the tree as it is (A) and,
# for each folder of $AB_DIR, from a copy of kernels/ with that folder's files laid over it (B, C, ...), then
# runs one command against each build in turn, $ROUNDS times (A, B, ..., A, B, ...), so that all of them share the
# machine and the run, and drift shows.
#   usage (repo root):  AB_DIR="ab1 ab2" AB_CMD="python3 scripts/probe_paged_prefill.py" bash scripts/gpu_ab.sh
# Each folder mirrors kernels/ (e.g. ab1/cuda/attention_sm90.cuh replaces kernels/cuda/attention_sm90.cuh); a
# variant kept on a branch can be put there with `git show BRANCH:kernels/cuda/X > ab1/cuda/X`. A folder may also
# hold msa_ops/ files (ab1/msa_ops/routing.py replaces msa_ops/routing.py): that variant's command then runs in a
# copy of the repository's Python side with them laid over it (for a ladder change that goes with a kernel change).
# The folders must be present on the GPU machine: copy them there with the tree.
set -uo pipefail
PY=${PY:-python3}
AB_DIR=${AB_DIR:?AB_DIR: folders of replacement kernel files (space-separated)}
AB_CMD=${AB_CMD:?AB_CMD: the command to run against each build}
ROUNDS=${ROUNDS:-2}
# AB_ROOT: the repository root, for commands that run in a variant's copied tree (which holds only msa_ops, tests,
# benchmarks and scripts): `AB_CMD='bash $AB_ROOT/my_cmd.sh'`.
export AB_ROOT=$PWD
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
build() {  # build SRC_DIR BUILD_DIR
  cmake -S "$1" -B "$2" -G Ninja -DPython_EXECUTABLE="$(command -v "$PY")" -DMSA_OPS_CUDA_ARCHS=90a \
    -DCMAKE_BUILD_TYPE=Release > "$2.log" 2>&1 && cmake --build "$2" -j 16 >> "$2.log" 2>&1 \
    || { tail -n 30 "$2.log"; return 1; }
}
for d in $AB_DIR; do  # a folder that did not travel would silently give a second build of the tree
  if [ -z "$(find "$d" -type f 2>/dev/null | head -n 1)" ]; then
    echo "gpu_ab.sh: folder '$d' is missing or empty here (ignored by git, so not carried?)" >&2; exit 2
  fi
done
names=(A)
rm -rf /tmp/ab_tree_*
build kernels /tmp/ab_build_A & pids=($!)
letter=B
for d in $AB_DIR; do
  rm -rf "/tmp/ab_src_$letter" && cp -r kernels "/tmp/ab_src_$letter" && cp -r "$d"/. "/tmp/ab_src_$letter/" || exit 2
  echo "build $letter: kernels/ + $d ($(cd "$d" && find . -type f | sed 's|^\./||' | tr '\n' ' '))"
  if [ -d "$d/msa_ops" ]; then  # the Python side with this variant's package files laid over it
    t="/tmp/ab_tree_$letter"
    mkdir -p "$t" && cp -r msa_ops tests benchmarks scripts "$t/" && cp -p ./*.toml "$t/" 2>/dev/null
    cp -r "$d"/msa_ops/. "$t/msa_ops/"
  fi
  build "/tmp/ab_src_$letter" "/tmp/ab_build_$letter" & pids+=($!)
  names+=("$letter")
  letter=$(echo "$letter" | tr 'A-Y' 'B-Z')
done
for p in "${pids[@]}"; do wait "$p" || exit 1; done
for r in $(seq "$ROUNDS"); do
  for v in "${names[@]}"; do
    echo "=== round $r, build $v"
    dir=$PWD
    [ -d "/tmp/ab_tree_$v" ] && dir=/tmp/ab_tree_$v
    pp=$dir${PYTHONPATH#"$PWD"}  # before the cd below: the repository root in front swapped for $dir
    (cd "$dir" && PYTHONPATH=$pp MSA_OPS_LIBRARY_DIR=/tmp/ab_build_$v bash -c "$AB_CMD") 2>&1 | grep -v "Warning"
  done
done
