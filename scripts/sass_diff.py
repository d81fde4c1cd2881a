"""Compare the SASS of two builds of the CUDA library, function by function.

A clean-up of kernel code that leaves every function's SASS byte-identical needs no GPU A/B; this tells which
functions moved. Build both trees with the same flags (BUILD.md, "Reading SASS"), then:

    python scripts/sass_diff.py BASE/libmsa_ops_cuda.so NEW/libmsa_ops_cuda.so
    python scripts/sass_diff.py A.so B.so --targets          # branch and call targets read as equal
    python scripts/sass_diff.py A.so B.so --show attention_sm90_kernelI13__nv_bfloat16Li128 --lines 80

Names are compared with the anonymous namespace's per-file hash taken out; instruction encodings and addresses
are left out, so two functions are "identical" when their instruction text is. cuobjdump (and the nvdisasm it
runs) come from $CUOBJDUMP, PATH, or the CUDA toolkit beside nvcc; NVIDIA's wheels nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm install both where the toolkit lacks them. Exit status: 0 when every common function is
identical and both sides hold the same functions, 1 otherwise.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys

_FUNC = re.compile(r"\s*Function : (\S+)")
_ANON = re.compile(r"_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+")
_ENCODING = re.compile(r"/\*[0-9a-f]{4,}\*/|/\* 0x[0-9a-f]{16} \*/")
_TARGET = re.compile(r"((?:BRA|CALL|BSSY|BREAK|BRX|JMP)\S*\s+(?:\S+,\s*)*)0x[0-9a-f]+")


def find_cuobjdump() -> str:
    for cand in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")):
        if cand:
            return cand
    nvcc = shutil.which("nvcc")
    if nvcc:
        with open(nvcc, "rb") as f:  # a wrapper script names the real toolkit
            m = re.search(rb"(/\S+/bin)/nvcc", f.read(4096))
        for d in ([m.group(1).decode()] if m else []) + [os.path.dirname(os.path.realpath(nvcc))]:
            p = os.path.join(d, "cuobjdump")
            if os.path.exists(p):
                return p
    sys.exit("sass_diff: no cuobjdump (set CUOBJDUMP, or pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")


def tool_env(cuobjdump: str) -> dict:
    """The environment to run cuobjdump (or nvdisasm) in: its own folder first on PATH, for its nvdisasm."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(cuobjdump) + os.pathsep + env.get("PATH", "")
    return env


def sass_text(lib: str, cuobjdump: str, who: str = "sass_diff") -> str:
    """`cuobjdump -sass lib`'s output (exits, saying so, where it fails or holds no function)."""
    r = subprocess.run([cuobjdump, "-sass", lib], capture_output=True, text=True, env=tool_env(cuobjdump))
    if r.returncode != 0 or "Function :" not in r.stdout:
        sys.exit(f"{who}: cuobjdump -sass {lib} failed: {r.stderr.strip()[:400]}")
    return r.stdout


def functions(lib: str, cuobjdump: str, targets: bool) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    body: list[str] | None = None
    for line in sass_text(lib, cuobjdump).splitlines():
        m = _FUNC.match(line)
        if m:
            name = _ANON.sub("ANON", m.group(1))
            while name in out:  # the same kernel name in two translation units
                name += "#"
            body = out[name] = []
            continue
        if body is None or "ptxasOptions" in line:
            continue
        line = _ENCODING.sub("", line)
        if targets:
            line = _TARGET.sub(r"\1T", line)
        if line.strip():
            body.append(line.rstrip())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--targets", action="store_true", help="read branch and call targets as equal")
    ap.add_argument("--show", metavar="SUBSTR", help="print the diff of the first differing function matching it")
    ap.add_argument("--lines", type=int, default=120, help="diff lines --show prints")
    args = ap.parse_args()
    tool = find_cuobjdump()
    a = functions(args.base, tool, args.targets)
    b = functions(args.new, tool, args.targets)
    common = [k for k in a if k in b]
    differ = [k for k in common if a[k] != b[k]]
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    print(f"{len(a)} / {len(b)} functions: {len(common) - len(differ)} identical, {len(differ)} differ, "
          f"{len(only_a)} only in base, {len(only_b)} only in new")
    for k in differ:
        print(f"  differs ({len(a[k])} -> {len(b[k])} lines): {k}")
    for k in only_a:
        print(f"  only in base: {k}")
    for k in only_b:
        print(f"  only in new: {k}")
    if args.show:
        hits = [k for k in differ if args.show in k]
        if not hits:
            print(f"no differing function matches {args.show!r}")
        else:
            d = difflib.unified_diff(a[hits[0]], b[hits[0]], "base", "new", lineterm="", n=1)
            for line in list(d)[: args.lines]:
                print(line)
    return 0 if not differ and not only_a and not only_b else 1


if __name__ == "__main__":
    sys.exit(main())
