#!/usr/bin/env bash
# Here, before a GPU call: one A/B folder per branch for scripts/gpu_ab.sh. For each BRANCH, the files under
# kernels/ that it changed since it forked from HEAD's history go to ab_<branch, / as -> (paths relative to
# kernels/, as gpu_ab.sh lays them over its copy), and the folder names are printed for AB_DIR. A branch whose
# files HEAD has changed since the fork is refused (rebase it first).
#   usage (repo root):  AB_DIR="$(bash scripts/ab_folders.sh wip/a wip/b)"
# The folders must travel to the GPU machine: untracked and not ignored by git (gpu_ab.sh stops if one is missing).
set -euo pipefail
dirs=()
for br in "$@"; do
  d="ab_${br//\//-}"
  rm -rf "$d"
  base=$(git merge-base HEAD "$br")
  files=$(git diff --name-only "$base" "$br" -- kernels/)
  [ -n "$files" ] || { echo "ab_folders.sh: $br changes nothing under kernels/" >&2; exit 2; }
  moved=$(git diff --name-only "$base" HEAD -- $files)
  [ -z "$moved" ] || { echo "ab_folders.sh: HEAD changed" $moved "since $br forked: rebase it first" >&2; exit 2; }
  for f in $files; do
    mkdir -p "$d/$(dirname "${f#kernels/}")"
    git show "$br:$f" > "$d/${f#kernels/}"
  done
  if git check-ignore -q "$d/x" 2>/dev/null; then
    echo "ab_folders.sh: $d is ignored by git and would not travel" >&2; exit 2
  fi
  dirs+=("$d")
done
echo "${dirs[*]}"
