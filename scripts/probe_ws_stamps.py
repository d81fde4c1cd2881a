"""Where a work item's time goes in the persistent dense prefill kernel (attention_ws_sm90.cuh), from the phase
stamps of a profiling build (ws_sm90.cuh: CTA 5's first 64 items, clock64 at each point):

  cmake -S kernels -B /tmp/bst -G Ninja -DMSA_OPS_CUDA_ARCHS=90a -DCMAKE_BUILD_TYPE=Release -DMSA_OPS_WS_STAMPS=ON
  cmake --build /tmp/bst && MSA_OPS_LIBRARY_DIR=/tmp/bst python3 scripts/probe_ws_stamps.py [--ghz 1.75]

BENCH.md's prefill shapes (bf16, D=128, H=16, B*S=16384 or --total, contiguous K/V). Cycles are converted at --ghz
(ncu read 1.73-1.76 GHz for this kernel on an H200). Prints, per shape, the medians over the CTA's items of each
phase, and across the two roles (one SM's clock) when the loader issued each item's first K tile against the
consumers' steps. The pair kernel (MSA_OPS_DENSE_WS_PAIR) stamps its first pair: loader warp 0 and its warpgroup.
"""

import argparse
import ctypes
import time

import jax
import jax.numpy as jnp
import numpy as np

import msa_ops
from msa_ops import _native

CONSUMER = ["start", "Q landed", "K 0 landed", "first turn", "first step done", "last step done", "last P.V done",
            "stored"]
LOADER = ["start", "placed", "Q buffer free", "Q issued", "key range", "K 0 issued", "all issued"]
SHAPE = (2, 64, 8)  # ws_sm90.cuh: roles, kWsStampItems, kWsStampPoints


# A profiling build's stamp array: the library's reader (its writer adds _set), the array's shape, the build option.
# Also read by scripts/probe_msa_stamps.py, with the MSA decode kernel's array.
WS_STAMPS = ("msa_ops_ws_stamps", SHAPE, "MSA_OPS_WS_STAMPS")


def _lib(which):
    symbol, _, option = which
    path = _native.info()["platforms"]["cuda"]["library"]
    lib = ctypes.CDLL(path)
    if not hasattr(lib, symbol):
        raise SystemExit(f"{path} is not a profiling build (-D{option}=ON)")
    return lib


def reset(which=WS_STAMPS):
    """Zeroes the stamps (a synchronous copy)."""
    symbol, shape, _ = which
    buf = np.zeros(shape, np.int64)
    rc = getattr(_lib(which), symbol + "_set")(buf.ctypes.data_as(ctypes.c_void_p))
    if rc != 0:
        raise SystemExit(f"{symbol}_set: CUDA error {rc}")


def stamps(which=WS_STAMPS):
    """The stamp array; by default the prefill kernel's [role][item][point]: role 0 the loader, role 1 the first
    consumer thread."""
    symbol, shape, _ = which
    buf = np.zeros(shape, np.int64)
    rc = getattr(_lib(which), symbol)(buf.ctypes.data_as(ctypes.c_void_p))
    if rc != 0:
        raise SystemExit(f"{symbol}: CUDA error {rc}")
    return buf


def run(s, mask, ghz, total=16384):
    h, d = 16, 128
    b = max(1, total // s)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(k1, (b * s, h, d), jnp.bfloat16)
    k = jax.random.normal(k2, (b * s, h, d), jnp.bfloat16)
    v = jax.random.normal(k3, (b * s, h, d), jnp.bfloat16)
    offs = jnp.arange(b + 1, dtype=jnp.int32) * s
    f = jax.jit(lambda q, k, v: msa_ops.mha_ragged_no_cache(q, k, v, offs, mask_str=mask, implementation="native"))
    jax.block_until_ready(f(q, k, v))
    reset()  # every call stamps the same items: after the timed calls the array holds the last call's
    t0 = time.perf_counter()
    for _ in range(20):
        r = f(q, k, v)
    jax.block_until_ready(r)
    dt = (time.perf_counter() - t0) / 20
    l, c = stamps()  # role 0: the loader, role 1: the consumer
    cyc = ghz * 1e3  # cycles per us
    n = 1
    while n < 64 and c[n, 0] > c[n - 1, 0]:
        n += 1
    full = [i for i in range(n) if all(c[i, j] >= c[i, j - 1] for j in range(1, 8))]  # items with tiles
    print(f"\n## S={s} mask={mask} B={b}: {dt * 1e6:.1f} us a call (host-timed); CTA 5: {n} items, {len(full)} "
          f"with keys; us at {ghz} GHz")
    dc = {name: np.median([c[i, j + 1] - c[i, j] for i in full]) / cyc for j, name in enumerate(CONSUMER[1:])}
    print("consumer, from the previous point: " + ", ".join(f"{k} {v:.2f}" for k, v in dc.items()))
    print("item, start to start: %.2f" % (np.median(np.diff(c[:n, 0])) / cyc))
    dl = {name: np.median([l[i, j + 1] - l[i, j] for i in full]) / cyc for j, name in enumerate(LOADER[1:])}
    print("loader, from the previous point: " + ", ".join(f"{k} {v:.2f}" for k, v in dl.items()))
    # Both roles stamp the same SM's clock, so their points compare directly (item i of one = item i of the other).
    nxt = [i for i in full if i - 1 in full]
    cross = {
        "loader's item start after the consumers' previous last step": [l[i, 0] - c[i - 1, 5] for i in nxt],
        "K 0 issued after the consumers' previous last step": [l[i, 5] - c[i - 1, 5] for i in nxt],
        "K 0 issued before the consumers' item start": [c[i, 0] - l[i, 5] for i in full],
        "K 0 landed (seen) after its issue": [c[i, 2] - l[i, 5] for i in full],
    }
    print("across roles: " + ", ".join(f"{k} {np.median(v) / cyc:.2f}" for k, v in cross.items() if v))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ghz", type=float, default=1.75)
    ap.add_argument("--cases", default="512:null,512:causal,2048:null,8192:null")
    ap.add_argument("--total", type=int, default=16384, help="B*S of each case")
    args = ap.parse_args()
    for case in args.cases.split(","):
        s, mask = case.split(":")
        run(int(s), mask, args.ghz, args.total)


if __name__ == "__main__":
    main()
