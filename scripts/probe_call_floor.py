"""What a call costs when it does almost nothing, timed as the benchmarks time calls (ten to a jitted function, which
XLA runs as a CUDA graph), beside the same floor in a plain CUDA graph (CuPy); and the MSA decode call at the
benchmark's grid (B=32, H=32, Hkv=4: 128 CTAs) over topk 1..32, whose line through the points splits a call into a
fixed part and a part per selected block. One line out per item, for the GPU machine:
  python3 scripts/probe_call_floor.py
"""

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # CuPy allocates beside JAX

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from gpu_decode_ceiling import cupy_graph_timer  # noqa: E402
from gpu_gather_ceiling import cupy_device  # noqa: E402
from gpu_msa import HKV, B, D, H, decode_case, decode_ids, msa_call  # noqa: E402
from harness import bench_in_graph  # noqa: E402


def us(t):
    return f"{t * 1e6:.2f}us"


def xla_floors():
    x = jnp.ones((8, 128), jnp.float32)
    out = {"xla_elementwise": bench_in_graph(lambda a: a * 2.0 + 1.0, (x,))}
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 1, 8, 128), jnp.bfloat16)
    k = jax.random.normal(jax.random.PRNGKey(1), (1, 128, 1, 128), jnp.bfloat16)

    def cud(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

    out["cudnn_1x128"] = bench_in_graph(cud, (q, k, k))
    return out


def msa_tiny():
    """One CTA: one sequence, one kv head of 8 heads, one selected block of 128 keys."""
    kv = jax.random.normal(jax.random.PRNGKey(2), (1, 2, 1, 128, 1, D), jnp.bfloat16)
    q = jax.random.normal(jax.random.PRNGKey(3), (1, 8, D), jnp.bfloat16)
    offs = jnp.arange(2, dtype=jnp.int32)
    cl = jnp.full((1,), 127, jnp.int32)
    lut = jnp.zeros((1, 1), jnp.int32)
    ids = jnp.zeros((1, 1, 1), jnp.int32)
    return bench_in_graph(msa_call(0), (q, kv, ids, offs, cl, lut))


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
    f = xla_floors()
    f["msa_1cta_1block"] = msa_tiny()
    f.update(cupy_floors())
    print("FLOOR " + " | ".join(f"{k} {us(v) if isinstance(v, float) else v}" for k, v in f.items()), flush=True)
    rng = np.random.default_rng(0)
    kv16, kv8, lut, offs, cl, q16, q8 = decode_case(32768, rng)
    for name, q, kv in (("bf16", q16, kv16), ("fp8", q8, kv8)):
        ks, ts = [], []
        for topk in (1, 2, 4, 8, 16, 32):
            ids = decode_ids(rng, 32768 // 128, topk)
            ts.append(bench_in_graph(msa_call(1), (q, kv, ids, offs, cl, lut)))
            ks.append(topk)
        slope, icpt = np.polyfit(ks[2:], ts[2:], 1)
        print(f"FLOOR msa {name} B={B} H={H} Hkv={HKV} 1 partition: "
              + " ".join(f"k{k} {us(t)}" for k, t in zip(ks, ts))
              + f" | fit k4-32: {us(icpt)} + {us(slope)}/block", flush=True)


if __name__ == "__main__":
    main()
