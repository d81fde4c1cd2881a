#!/usr/bin/env bash
# A/B of settings read once per process (an environment variable such as MSA_OPS_PDL, or XLA_FLAGS): runs one
# command once per setting and round, each in its own process against the same build, the order rotated from
# round to round (the first process after an idle stretch reads faster: benchmarks/harness.py, bench_rounds).
#   usage (repo root, MSA_OPS_LIBRARY_DIR set):
#     AB_SETTINGS="MSA_OPS_PDL=1 | MSA_OPS_PDL=0; XLA_FLAGS=--xla_gpu_enable_command_buffer=" ROUNDS=3 \
#       AB_CMD="python3 scripts/probe_msa_decode_ab.py --topk 16" bash scripts/ab_env.sh
# Settings are separated by '|'; within one, NAME=VALUE assignments by ';' (values may hold spaces and commas).
# Each output line is prefixed with its setting; the exit status is 1 if any run failed.
set -uo pipefail
AB_SETTINGS=${AB_SETTINGS:?AB_SETTINGS: settings separated by |}
AB_CMD=${AB_CMD:?AB_CMD: the command to run under each setting}
ROUNDS=${ROUNDS:-2}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
IFS='|' read -r -a settings <<< "$AB_SETTINGS"
n=${#settings[@]}
status=0
for r in $(seq "$ROUNDS"); do
  for i in $(seq 0 $((n - 1))); do
    s=${settings[$(((r - 1 + i) % n))]}
    s=$(echo "$s" | sed -e 's/^ *//' -e 's/ *$//')
    echo "=== round $r: $s"
    (IFS=';' read -r -a kv <<< "$s"
     for e in "${kv[@]}"; do e=$(echo "$e" | sed -e 's/^ *//' -e 's/ *$//'); [ -n "$e" ] && export "$e"; done
     bash -c "$AB_CMD" 2>&1) | while IFS= read -r line; do printf '[%s] %s\n' "$s" "$line"; done
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
done
exit $status
