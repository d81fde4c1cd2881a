"""The loops of one kernel's SASS: how many instructions a loop body holds and, with line info, which source lines.

A decode CTA alone on an SM gives each scheduler one warp, so its key tile's instructions run as one dependent
stream and their count bounds how fast the CTA streams (benchmarks/NOTES_mha.md v65, v66): a figure to read before
spending GPU time. Lists the backward branches whose body holds MMAs or copies (start, length, and the counts of
the instructions that matter), the tile loop first. With --lines N, attributes that loop's instructions to source
lines (the N heaviest, with their text), which needs a cubin built with -lineinfo, for example one kernel:

    nvcc -O3 -DNDEBUG -gencode arch=compute_90a,code=sm_90a -lineinfo --expt-relaxed-constexpr -std=c++17 \\
      -Ikernels/include -I$BUILD/generated -isystem $JAXLIB/include -cubin one.cu -o one.cubin

where one.cu includes kernels/cuda/attention.cuh and instantiates the kernel explicitly, $BUILD is a CMake build
folder of kernels/ and $JAXLIB the jaxlib package's folder (python -c "import jaxlib; print(jaxlib.__path__[0])").

Usage (repo root):
    python scripts/sass_loops.py $BUILD/libmsa_ops_cuda.so attention_kernelI13__nv_bfloat16Li128ELi8ELi3ELb0ELi2E
    python scripts/sass_loops.py one.cubin attention_kernel --lines 25

cuobjdump and nvdisasm as for scripts/sass_diff.py (CUOBJDUMP, PATH, or the toolkit beside nvcc).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_diff import find_cuobjdump, sass_text, tool_env  # noqa: E402

_FUNC = re.compile(r"\s*Function : (\S+)")
_INSN = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
COUNTED = ("HMMA", "HGMMA", "QGMMA", "LDSM", "LDGSTS", "UTMALDG", "LDG", "STS", "BAR.SYNC", "SHFL", "MUFU")


def kernel_sass(path: str, name: str, tool: str) -> tuple[str, list[tuple[int, str]]]:
    """(full name, [(address, instruction)]) of the first function whose name holds `name`."""
    found, insns = None, []
    for line in sass_text(path, tool, "sass_loops").splitlines():
        m = _FUNC.match(line)
        if m:
            if found:
                break
            found = m.group(1) if name in m.group(1) else None
            continue
        if found:
            mi = _INSN.match(line)
            if mi:
                insns.append((int(mi.group(1), 16), mi.group(2)))
    if not found:
        sys.exit(f"sass_loops: no function matching {name!r} in {path}")
    return found, insns


def loops(insns: list[tuple[int, str]]) -> list[dict]:
    """Backward branches whose body holds an MMA or a copy: those with the most MMAs first, shortest first among
    them (a block placed after the loop that branches back into it spans more than the loop: the shortest span
    holding all of a tile's MMAs is the tile loop)."""
    index = {a: i for i, (a, _) in enumerate(insns)}
    out = []
    for i, (_, text) in enumerate(insns):
        m = _BRANCH.search(text)
        if not m or int(m.group(1), 16) not in index or index[int(m.group(1), 16)] >= i:
            continue
        s = index[int(m.group(1), 16)]
        ops = [t.split()[0] if not t.startswith("@") else t.split()[1] for _, t in insns[s:i + 1]]
        counts = {k: sum(op == k or op.startswith(k + ".") for op in ops) for k in COUNTED}
        if any(counts[k] for k in ("HMMA", "HGMMA", "QGMMA", "LDGSTS", "UTMALDG", "LDG")):
            out.append({"start": s, "end": i, "length": i - s + 1, "first": insns[s][0], "last": insns[i][0],
                        **counts})
    return sorted(out, key=lambda d: (-(d["HMMA"] + d["HGMMA"] + d["QGMMA"]), d["length"]))


def line_counts(cubin: str, name: str, first: int, last: int, tool: str) -> collections.Counter:
    """Instructions at addresses [first, last] of the function, by (file, line), from nvdisasm's line info."""
    nvdisasm = os.path.join(os.path.dirname(tool), "nvdisasm")
    r = subprocess.run([nvdisasm if os.path.exists(nvdisasm) else "nvdisasm", "-g", "-c", cubin],
                       capture_output=True, text=True, env=tool_env(tool))
    if r.returncode != 0:
        sys.exit(f"sass_loops: nvdisasm -g {cubin} failed (a cubin is needed): {r.stderr.strip()[:400]}")
    counts: collections.Counter = collections.Counter()
    cur, inside = None, False
    for line in r.stdout.splitlines():
        if ".text." in line and ":" in line and not line.lstrip().startswith("/"):
            inside = name in line
        m = _LINE.search(line)
        if m:
            cur = (m.group(1), int(m.group(2)))
            continue
        mi = re.match(r"\s*/\*([0-9a-f]{4,})\*/", line)
        if inside and mi and first <= int(mi.group(1), 16) <= last:
            counts[cur] += 1
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a shared library or cubin")
    ap.add_argument("kernel", help="a substring of the function's (mangled) name; the first match is read")
    ap.add_argument("--most", type=int, default=8, help="loops to list")
    ap.add_argument("--lines", type=int, default=0, metavar="N", help="the first loop's N heaviest source lines")
    args = ap.parse_args()
    tool = find_cuobjdump()
    name, insns = kernel_sass(args.path, args.kernel, tool)
    found = loops(insns)
    print(f"{name}: {len(insns)} instructions, {len(found)} loops with MMAs or copies")
    for d in found[:args.most]:
        counts = ", ".join(f"{k} {d[k]}" for k in COUNTED if d[k])
        print(f"  [{d['start']}, {d['end']}] {d['length']} instructions: {counts}")
    if args.lines and found:
        d = found[0]
        counts = line_counts(args.path, name, d["first"], d["last"], tool)
        print(f"the first loop by source line ({sum(counts.values())} instructions):")
        for (f, ln), c in counts.most_common(args.lines) if counts else []:
            text = ""
            if f and os.path.exists(f):
                with open(f) as fh:
                    src = fh.read().splitlines()
                text = src[ln - 1].strip()[:90] if 0 < ln <= len(src) else ""
            print(f"  {c:5d}  {os.path.basename(f) if f else '?'}:{ln}  {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
