#!/usr/bin/env bash
# A/B of settings read once per process (an environment variable such as MSA_OPS_PDL, or XLA_FLAGS): runs one
# command once per setting and round, each in its own process against the same build, the order rotated from
# round to round (the first process after an idle stretch reads faster: benchmarks/harness.py, bench_rounds).
#   usage (repo root, MSA_OPS_LIBRARY_DIR set):
#     AB_SETTINGS="MSA_OPS_PDL=1 MSA_OPS_PDL=0" ROUNDS=3 AB_CMD="python3 scripts/probe_msa_decode_ab.py --topk 16" \
#       bash scripts/ab_env.sh
# A setting is NAME=VALUE, or several joined by commas (NAME=VALUE,NAME2=VALUE2); each output line is prefixed
# with its setting.
set -uo pipefail
AB_SETTINGS=${AB_SETTINGS:?AB_SETTINGS: space-separated settings}
AB_CMD=${AB_CMD:?AB_CMD: the command to run under each setting}
ROUNDS=${ROUNDS:-2}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
read -r -a settings <<< "$AB_SETTINGS"
n=${#settings[@]}
for r in $(seq "$ROUNDS"); do
  for i in $(seq 0 $((n - 1))); do
    s=${settings[$(((r - 1 + i) % n))]}
    echo "=== round $r, $s"
    (IFS=, read -r -a kv <<< "$s"; for e in "${kv[@]}"; do export "${e?}"; done
     bash -c "$AB_CMD" 2>&1 | grep -v "Warning" | sed "s|^|[$s] |")
  done
done
