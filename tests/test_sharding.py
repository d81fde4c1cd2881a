"""Sharding across devices: the ops inside jax.shard_map over heads (query heads with their kv heads) give the
unsharded result, and a jitted call on sharded inputs (no sharding rule yet: XLA gathers them) is correct too.
Runs in a subprocess with 4 virtual CPU devices."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CODE = textwrap.dedent(r'''
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import msa_ops

    assert len(jax.devices()) == 4, jax.devices()
    rng = np.random.default_rng(0)
    b, h, hkv, d, page, mp = 3, 16, 4, 64, 16, 8
    n = [5, 1, 9]
    cl = np.array([20, 0, 60], np.int32)
    t = sum(n) + 2
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    kv = jnp.asarray(rng.standard_normal((b * mp + 2, 2, 2, page, hkv, d)), jnp.float32)
    lut = jnp.asarray(rng.permutation(b * mp + 2)[: b * mp].reshape(b, mp), jnp.int32)
    q = jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)
    sink = jnp.asarray(rng.standard_normal((h,)), jnp.float32)

    def attn(q, kv, sink):
        return msa_ops.mha_ragged_paged(q, offs, kv, cl, lut, 1, mask_str="causal", sink_weights=sink,
                                        num_partitions=2, implementation=os.environ["IMPL"])

    want = np.asarray(jax.jit(attn)(q, kv, sink))
    mesh = Mesh(np.array(jax.devices()), ("heads",))
    sharded = jax.jit(jax.shard_map(attn, mesh=mesh,
                                    in_specs=(P(None, "heads", None), P(None, None, None, None, "heads", None),
                                              P("heads")),
                                    out_specs=P(None, "heads", None)))
    got = np.asarray(sharded(q, kv, sink))
    print("SHARD_MAP", float(np.abs(got - want).max()))
    qs = jax.device_put(q, NamedSharding(mesh, P(None, "heads", None)))
    kvs = jax.device_put(kv, NamedSharding(mesh, P(None, None, None, None, "heads", None)))
    got2 = np.asarray(jax.jit(attn)(qs, kvs, sink))
    print("JIT_SHARDED", float(np.abs(got2 - want).max()))
''')


def _run(impl: str) -> str:
    import tempfile
    from pathlib import Path

    import msa_ops

    # The child imports the same msa_ops as this process (the installed one, with its libraries), not a
    # source tree that happens to be the working directory.
    pkg_root = str(Path(msa_ops.__file__).resolve().parent.parent)
    env = dict(os.environ, IMPL=impl)
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in [env.get("PYTHONPATH")] if p])
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=300,
                           cwd=cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _check(out: str) -> None:
    vals = dict(line.split() for line in out.splitlines() if line.startswith(("SHARD_MAP", "JIT_SHARDED")))
    assert float(vals["SHARD_MAP"]) < 1e-5, out
    assert float(vals["JIT_SHARDED"]) < 1e-5, out


def test_shard_map_over_heads_reference():
    _check(_run("reference"))


def test_shard_map_over_heads_native():
    import pytest

    from msa_ops import _native

    if not _native.available("cpu"):
        pytest.skip("native CPU library not available")
    _check(_run("native"))
