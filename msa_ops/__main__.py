"""Command line: ``python -m msa_ops demo | info | bench``."""

from __future__ import annotations

import argparse
import json
import sys


def _info() -> int:
    import jax

    import msa_ops

    print(f"msa_ops {msa_ops.__version__}")
    print(f"jax {jax.__version__}, jaxlib {getattr(__import__('jaxlib'), '__version__', '?')}, "
          f"backend {jax.default_backend()}, devices {[d.device_kind for d in jax.devices()]}")
    print("ops:")
    for n in msa_ops.list_ops():
        print(f"  {n}")
    try:
        from msa_ops import _native
    except ImportError as e:
        print(f"native: unavailable ({e})")
        return 0
    for plat in ("cpu", "cuda"):
        ok = _native.available(plat)
        print(f"native {plat}: {'loaded' if ok else 'not loaded: ' + _native.missing_reason(plat)}")
        if ok:
            print(f"  targets: {', '.join(_native.registered_targets(plat))}")
    print(json.dumps(_native.info(), indent=2, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m msa_ops")
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="prefill + decode (dense and MSA) through the ops, checked in float64")
    d.add_argument("--steps", type=int, default=8)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--implementation", default="auto", choices=["auto", "reference", "native"])
    sub.add_parser("info", help="versions, native libraries, FFI targets, CUDA archs")
    sub.add_parser("bench", help="run the CPU benchmark (benchmarks/cpu_bench.py: decode, prefill, MSA decode and "
                   "indexer, native against the reference); the arguments after 'bench' go to it (e.g. python -m "
                   "msa_ops bench --help)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.cmd != "bench" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "demo":
        from .demo import run_demo

        return run_demo(steps=args.steps, seed=args.seed, implementation=args.implementation)
    if args.cmd == "info":
        return _info()
    if args.cmd == "bench":
        import runpy
        from pathlib import Path

        # The source tree this package came from, else the working directory (an installed package run from its
        # checkout).
        where = [w / "benchmarks" / "cpu_bench.py" for w in (Path(__file__).resolve().parent.parent, Path.cwd())]
        script = next((w for w in where if w.exists()), None)
        if script is None:
            print(f"benchmark script not found at {' or '.join(map(str, where))} (run from a source checkout)")
            return 2
        sys.argv = [str(script), *(rest[1:] if rest[:1] == ["--"] else rest)]
        runpy.run_path(str(script), run_name="__main__")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
