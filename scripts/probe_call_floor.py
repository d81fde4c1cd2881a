"""What a call costs when it does almost nothing, timed as the benchmarks time calls (ten to a jitted function, which
XLA runs as a CUDA graph), beside the same floor in a plain CUDA graph (CuPy); and the MSA decode call at the
benchmark's grid (B=32, H=32, Hkv=4: 128 CTAs) over topk 1..32, whose line through the points splits a call into a
fixed part and a part per selected block. One line out per item, for the GPU machine:
  python3 scripts/probe_call_floor.py

Ten independent calls pass ten copies of every operand, and the host's dispatch of such a jitted function takes
longer than ten small calls run (~10 us a call for ten 4 KB fusions on an H100): below ~20 us a call those lines
time the host. The `chained` lines time the device: CHAIN calls in one jitted function, each taking the previous
call's output as its input (as the layers of a decode step do), the other operands passed once. The `gap` lines
time the topk-16 call with 10, 25 and 50 calls a run, which splits a call's time from the gap a run of a jitted
function leaves on the device (`FLOOR_GAP_ONLY=1`: those lines alone).
"""

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # CuPy allocates beside JAX

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import msa_ops  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from gpu_decode_ceiling import cupy_graph_timer  # noqa: E402
from gpu_gather_ceiling import cupy_device  # noqa: E402
from gpu_msa import HKV, B, D, H, decode_case, decode_ids, msa_call  # noqa: E402
from harness import bench, bench_in_graph  # noqa: E402


def us(t):
    return f"{t * 1e6:.2f}us"


def cudnn_tiny():
    """cuDNN's attention of 8 heads over 128 keys (K as V): (the call, q, k)."""
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 1, 8, 128), jnp.bfloat16)
    k = jax.random.normal(jax.random.PRNGKey(1), (1, 128, 1, 128), jnp.bfloat16)
    return (lambda q, k: jax.nn.dot_product_attention(q, k, k, implementation="cudnn")), q, k


def xla_floors():
    x = jnp.ones((8, 128), jnp.float32)
    out = {"xla_elementwise": bench_in_graph(lambda a: a * 2.0 + 1.0, (x,))}
    cud, q, k = cudnn_tiny()
    out["cudnn_1x128"] = bench_in_graph(cud, (q, k))
    return out


CHAIN = 50


def chained(op, x, rest=(), n=CHAIN):
    """Seconds per call of n calls of op(x, *rest) in one jitted function, each call's x the previous call's output."""
    def f(x, *rest):
        for _ in range(n):
            x = op(x, *rest)
        return x

    return bench(jax.jit(f), (x, *rest)) / n


def xla_chained():
    """The device's floor of a graph node: an XLA reduction fusion on 4 KB (each call's sum feeds the next call's
    elements, which no one kernel can do, so each call is a kernel of its own), a cuDNN attention over 128 keys."""
    x = jnp.ones((8, 128), jnp.float32)
    out = {"xla_reduction": chained(lambda a: a * 0.5 + jnp.sum(a) * 1e-6, x)}
    cud, q, k = cudnn_tiny()
    out["cudnn_1x128"] = chained(cud, q, (k,))
    out["store_1row"] = store_chained()
    return out


def store_chained():
    """Our smallest kernel behind an FFI call: the KV store of one row into a one-page pool (the pool passes from
    call to call, updated in place)."""
    kvb = jax.random.normal(jax.random.PRNGKey(4), (1, 2, 1, 128, 1, D), jnp.bfloat16)
    k = jax.random.normal(jax.random.PRNGKey(5), (1, 1, D), jnp.bfloat16)
    offs = jnp.arange(2, dtype=jnp.int32)
    cl = jnp.full((1,), 5, jnp.int32)
    lut = jnp.zeros((1, 1), jnp.int32)

    def store(kvb, k, offs, cl, lut):
        return msa_ops.kv_cache_store_ragged_paged(kvb, k, k, offs, cl, lut, 0, implementation="native")

    return chained(store, kvb, (k, offs, cl, lut))


def msa_tiny_case():
    """One CTA: one sequence, one kv head of 8 heads, one selected block of 128 keys."""
    kv = jax.random.normal(jax.random.PRNGKey(2), (1, 2, 1, 128, 1, D), jnp.bfloat16)
    q = jax.random.normal(jax.random.PRNGKey(3), (1, 8, D), jnp.bfloat16)
    offs = jnp.arange(2, dtype=jnp.int32)
    cl = jnp.full((1,), 127, jnp.int32)
    lut = jnp.zeros((1, 1), jnp.int32)
    ids = jnp.zeros((1, 1, 1), jnp.int32)
    return q, (kv, ids, offs, cl, lut)


def msa_tiny():
    q, rest = msa_tiny_case()
    return bench_in_graph(msa_call(0), (q, *rest))


def cupy_floors():
    got = cupy_device("cupy floors")
    if got is None:
        return {"cupy": "n/a"}
    cp = got[0]
    src = r"""
extern "C" __global__ void empty(int* p) { if (p == nullptr) p[threadIdx.x] = 0; }
extern "C" __global__ void read1(const int* __restrict__ a, int* __restrict__ o) {
  if (threadIdx.x == 0) o[blockIdx.x] = a[blockIdx.x * 4096] + 1;
}
"""
    kern = {n: cp.RawKernel(src, n) for n in ("empty", "read1")}
    a = cp.ones(128 * 4096, cp.int32)
    o = cp.zeros(128, cp.int32)
    s = cp.cuda.Stream(non_blocking=True)
    return {
        "cupy_empty_1cta": cupy_graph_timer(cp, s, lambda: kern["empty"]((1,), (32,), (o,)))(),
        "cupy_read1_128cta": cupy_graph_timer(cp, s, lambda: kern["read1"]((128,), (128,), (a, o)))(),
    }


def main():
    print("FLOOR device", jax.devices()[0].device_kind, flush=True)
    if os.environ.get("FLOOR_GAP_ONLY", "0") not in ("", "0"):
        rng = np.random.default_rng(0)
        return dispatch_gap(rng, *decode_case(32768, rng))
    f = xla_floors()
    f["msa_1cta_1block"] = msa_tiny()
    f.update(cupy_floors())
    print("FLOOR " + " | ".join(f"{k} {us(v) if isinstance(v, float) else v}" for k, v in f.items()), flush=True)
    c = xla_chained()
    q, rest = msa_tiny_case()
    c["msa_1cta_1block"] = chained(msa_call(0), q, rest)
    print(f"FLOOR chained x{CHAIN} " + " | ".join(f"{k} {us(v)}" for k, v in c.items()), flush=True)
    rng = np.random.default_rng(0)
    kv16, kv8, lut, offs, cl, q16, q8 = decode_case(32768, rng)
    dispatch_gap(rng, kv16, kv8, lut, offs, cl, q16, q8)
    ks = (1, 2, 4, 8, 16, 32)
    ids = {k: decode_ids(rng, 32768 // 128, k) for k in ks}
    to_fp8 = lambda o: o.astype(q8.dtype)  # noqa: E731
    for name, q, kv in (("bf16", q16, kv16), ("fp8", q8, kv8)):
        ts = [bench_in_graph(msa_call(1), (q, kv, ids[k], offs, cl, lut)) for k in ks]
        if name == "bf16":
            cs = [chained(msa_call(1), q, (kv, ids[k], offs, cl, lut)) for k in ks]
        else:  # the output (bf16) goes back to e4m3 for the next call: one more (tiny) XLA node a call
            cs = [chained(lambda *a: to_fp8(msa_call(1)(*a)), q, (kv, ids[k], offs, cl, lut)) for k in ks]
        for how, t in (("independent", ts), (f"chained x{CHAIN}", cs)):
            slope, icpt = np.polyfit(ks[3:], t[3:], 1)
            print(f"FLOOR msa {name} B={B} H={H} Hkv={HKV} 1 partition, {how}: "
                  + " ".join(f"k{k} {us(v)}" for k, v in zip(ks, t))
                  + f" | fit k8-32: {us(icpt)} + {us(slope)}/block", flush=True)


def dispatch_gap(rng, kv16, kv8, lut, offs, cl, q16, q8, topk=16):
    """The topk-16 call at the benchmark's shape as n independent calls a jitted function (n = 10, 25, 50), with
    one block selection for every call and with four rotating ones (no call finds the one before's bytes in L2),
    and bf16 chained (each call's q the previous call's output): a gap G a run of the jitted function reads as
    t + G / n a call."""
    sets = [decode_ids(rng, 32768 // 128, topk) for _ in range(4)]
    for name, q, kv in (("bf16", q16, kv16), ("fp8", q8, kv8)):
        line = []
        for n in (10, 25, 50):
            same = bench_in_graph(msa_call(1), (q, kv, sets[0], offs, cl, lut), n=n)
            rot = bench_in_graph(msa_call(1), (q, kv, sets[0], offs, cl, lut), n=n,
                                 more=[(q, kv, ids, offs, cl, lut) for ids in sets[1:]])
            line.append(f"n={n}: same {us(same)} rotating {us(rot)}")
        if name == "bf16":
            for n in (10, 50):
                line.append(f"chained n={n}: {us(chained(msa_call(1), q, (kv, sets[0], offs, cl, lut), n=n))}")
        print(f"FLOOR gap {name} k{topk} independent " + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
