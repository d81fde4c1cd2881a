"""Where a kernel's warps wait, per SASS instruction, from Nsight Compute's source page.

Capture (GPU machine; one launch of the kernel, its warp-state samples per instruction):
  XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:KERNEL -c 1 --section SourceCounters \
      --section WarpStateStats --import-source no -f -o prof python3 SCRIPT ...
  ncu -i prof.ncu-rep --page source --csv --print-source sass > prof.csv
(without the preallocation switch, each profiled launch saves and restores most of the GPU's memory: minutes)

Read (anywhere):
  python3 scripts/ncu_stalls.py top prof.csv            # stall reasons, hottest instructions, samples by how
                                                        # often an instruction ran (per CTA, per tile, ...)
  python3 scripts/ncu_stalls.py diff base.csv new.csv   # same binary, two inputs: where the samples moved, and
                                                        # the instructions one run executes and the other does not
"""

import argparse
import collections
import csv
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _num(row, ix, key):
    return int(float(row[ix[key]] or 0))


def load(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")  # a kernel-name line may come first
    hdr, data = rows[start], rows[start + 1 :]
    ix = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in data:
        if len(r) < len(hdr):
            continue
        out.append(
            {
                "sass": re.sub(r"0x[0-9a-f]{8,}", "ADDR", r[ix["Source"]].strip()),  # branch targets are absolute
                "samples": _num(r, ix, SAMPLES),
                "executed": _num(r, ix, EXECUTED),
                "stalls": {s: _num(r, ix, s) for s in stalls},
            }
        )
    return out


def opcode(sass):
    words = sass.split()
    if words and words[0].startswith("@"):  # predicate
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def top3(ins):
    best = sorted(ins["stalls"].items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{k[6:]} {v}" for k, v in best if v)


def cmd_top(args):
    ins = load(args.csv)
    total = sum(i["samples"] for i in ins) or 1
    reasons = collections.Counter()
    for i in ins:
        reasons.update(i["stalls"])
    print(f"{total} samples, {sum(i['executed'] for i in ins)} warp instructions executed")
    print("stall reasons: " + ", ".join(f"{k[6:]} {100 * v / total:.1f}%" for k, v in reasons.most_common(8)))
    print(f"\nhottest {args.n} instructions (index, samples, times executed, sass, top reasons):")
    for n, i in sorted(enumerate(ins), key=lambda t: -t[1]["samples"])[: args.n]:
        print(f"{n:6d} {i['samples']:7d} {i['executed']:9d}  {i['sass'][:60]:60s} {top3(i)}")
    by_exec = collections.Counter()
    count = collections.Counter()
    for i in ins:
        by_exec[i["executed"]] += i["samples"]
        count[i["executed"]] += 1
    print(
        "\nsamples by times executed (instructions that ran equally often: one code region, e.g. once per warp "
        "of a CTA, or once per tile):"
    )
    for e, s in by_exec.most_common(8):
        print(f"  executed {e:9d} x: {count[e]:5d} instructions, {s:7d} samples ({100 * s / total:.1f}%)")


def cmd_diff(args):
    a, b = load(args.base), load(args.new)
    if [i["sass"] for i in a] != [i["sass"] for i in b]:
        raise SystemExit("not the same binary: the SASS differs")
    ta, tb = sum(i["samples"] for i in a), sum(i["samples"] for i in b)
    ea, eb = sum(i["executed"] for i in a), sum(i["executed"] for i in b)
    print(f"samples {ta} -> {tb} ({tb - ta:+d}); warp instructions executed {ea} -> {eb} ({eb - ea:+d})")
    moved = sorted(range(len(a)), key=lambda n: -(b[n]["samples"] - a[n]["samples"]))
    print("\nlargest increases (index, base, new, sass, new's top reasons):")
    for n in moved[: args.n]:
        print(f"{n:6d} {a[n]['samples']:7d} {b[n]['samples']:7d}  {a[n]['sass'][:60]:60s} {top3(b[n])}")
    only = [n for n in range(len(a)) if (a[n]["executed"] == 0) != (b[n]["executed"] == 0)]
    ran_b = sum(b[n]["executed"] for n in only if b[n]["executed"])
    ran_a = sum(a[n]["executed"] for n in only if a[n]["executed"])
    print(f"\ninstructions that ran in one input only: {len(only)} ({ran_a} executions in base, {ran_b} in new)")
    ops = collections.Counter()
    for n in only:
        if b[n]["executed"]:
            ops[opcode(a[n]["sass"])] += b[n]["executed"]
    print("  new's, by opcode: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("top")
    t.add_argument("csv")
    t.add_argument("-n", type=int, default=25)
    d = sub.add_parser("diff")
    d.add_argument("base")
    d.add_argument("new")
    d.add_argument("-n", type=int, default=25)
    args = ap.parse_args()
    {"top": cmd_top, "diff": cmd_diff}[args.cmd](args)


if __name__ == "__main__":
    main()
