"""Sharding across devices, in subprocesses with 4 virtual CPU devices:
- the ops inside jax.shard_map over heads (query heads with their kv heads) give the unsharded result;
- a jitted call on Auto-mode sharded inputs is correct (XLA gathers what the op needs);
- under explicit sharding (AxisType.Explicit) of the head axes, every head-parallel op runs per shard: the
  result equals the unsharded one, keeps the head sharding, and the compiled program gathers nothing;
- vmap over an explicitly sharded axis gives the unsharded result."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import child_env

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


def _run(impl: str, code: str = CODE) -> str:
    import tempfile
    env = child_env(IMPL=impl)  # the child's devices are forced host devices
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
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


EXPLICIT = textwrap.dedent(r'''
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import msa_ops

    impl = os.environ["IMPL"]
    mesh = jax.make_mesh((4,), ("heads",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(0)
    f32, bf16 = jnp.float32, jnp.bfloat16
    r = lambda shape, dt=f32: jnp.asarray(rng.standard_normal(shape), dt)
    b, h, hkv, d, page, mp = 3, 16, 4, 64, 16, 8
    n = [5, 1, 9]
    t = sum(n) + 2
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    cl = np.array([20, 0, 60], np.int32)
    lut = np.asarray(rng.permutation(b * mp + 2)[: b * mp].reshape(b, mp), np.int32)
    kv = r((b * mp + 2, 2, 2, page, hkv, d))
    # MSA: 128-token pages, D = 128, bf16
    mkv = r((b * 4 + 1, 2, 1, 128, hkv, 128), bf16)
    mlut = np.asarray(rng.permutation(b * 4 + 1)[: b * 4].reshape(b, 4), np.int32)
    mcl = np.array([300, 0, 40], np.int32)
    kb = r((b * 4 + 1, 1, 1, 128, 1, 32), bf16)
    ids = rng.integers(-1, 4, (hkv, t, 3)).astype(np.int32)
    cases = {  # name: (fn, args, head axis of each arg (None: replicated))
        "mha_ragged_paged": (lambda q, kv, s: msa_ops.mha_ragged_paged(q, offs, kv, cl, lut, 1, sink_weights=s,
                                                                       implementation=impl),
                             (r((t, h, d)), kv, r((h,))), (1, 4, None)),
        "mha_padded_paged": (lambda q, kv: msa_ops.mha_padded_paged(q, kv, cl, lut, 0, np.array([4, 1, 2], np.int32),
                                                                    implementation=impl),
                             (r((b, 4, h, d)), kv), (2, 4)),
        "mha_ragged_no_cache": (lambda q, k, v: msa_ops.mha_ragged_no_cache(q, k, v, offs, implementation=impl),
                                (r((t, h, d)), r((t, hkv, d)), r((t, hkv, d))), (1, 1, 1)),
        "mha_padded_no_cache": (lambda q, k, v: msa_ops.mha_padded_no_cache(q, k, v, np.array([4, 0, 2], np.int32),
                                                                            implementation=impl),
                                (r((b, 4, h, d)), r((b, 4, hkv, d)), r((b, 4, hkv, d))), (2, 2, 2)),
        "msa_attention": (lambda q, kv, i: msa_ops.msa_attention_ragged_paged(q, offs, None, kv, mcl, mlut, 0, i,
                                                                              implementation=impl),
                          (r((t, h, 128), bf16), mkv, ids), (1, 4, 0)),
        "msa_indexer": (lambda q: msa_ops.msa_indexer_ragged_paged(q, offs, kb, mcl, mlut, 0, topk=2,
                                                                    implementation=impl),
                        (r((t, 4, 32), bf16),), (1,)),
        "kv_cache_store": (lambda kv, k, v: msa_ops.kv_cache_store_ragged_paged(kv, k, v, offs, cl, lut, 1,
                                                                                implementation=impl),
                           (kv, r((t, hkv, d)), r((t, hkv, d))), (4, 1, 1)),
    }
    for name, (fn, args, axes) in cases.items():
        want = np.asarray(jax.jit(fn)(*args), np.float32)
        with jax.set_mesh(mesh):
            sharded = [jax.device_put(x, NamedSharding(mesh, P(*["heads" if i == ax else None
                                                                    for i in range(x.ndim)])))
                       for x, ax in zip(args, axes)]
            jf = jax.jit(fn)
            got = jf(*sharded)
            text = jf.lower(*sharded).compile().as_text()
        err = float(np.abs(np.asarray(got, np.float32) - want).max())
        print("CASE", name, err, "heads" in str(got.sharding.spec), "all-gather" in text)
    # Not head-parallel (the batch axis sharded): gathered first, still correct.
    q, k, v = r((4, 4, h, d)), r((4, 4, hkv, d)), r((4, 4, hkv, d))
    fn = lambda q, k, v: msa_ops.mha_padded_no_cache(q, k, v, np.array([4, 0, 2, 3], np.int32), implementation=impl)
    want = np.asarray(jax.jit(fn)(q, k, v))
    with jax.set_mesh(mesh):
        got = jax.jit(fn)(*[jax.device_put(x, NamedSharding(mesh, P("heads"))) for x in (q, k, v)])
    print("FALLBACK", float(np.abs(np.asarray(got) - want).max()))
    # vmap over an axis sharded on the mesh (the batching rule scans it, so it is gathered first; the heads stay
    # sharded): a stack of 4 queries, sharded along the stack and along the heads on a 2 x 2 mesh.
    mesh2 = jax.make_mesh((2, 2), ("v", "heads"), axis_types=(AxisType.Explicit,) * 2)
    qv = r((4, t, h, d))
    fn = jax.vmap(lambda q: msa_ops.mha_ragged_paged(q, offs, kv, cl, lut, 1, implementation=impl))
    want = np.asarray(jax.jit(fn)(qv))
    with jax.set_mesh(mesh2):
        got = jax.jit(fn)(jax.device_put(qv, NamedSharding(mesh2, P("v", None, "heads", None))))
    oc = r((4, b), f32).astype(jnp.int32) % 50
    fo = jax.vmap(lambda c: msa_ops.kv_cache_row_offsets_ragged_paged(offs, c, implementation=impl))
    with jax.set_mesh(mesh):
        got_o = jax.jit(fo)(jax.device_put(oc, NamedSharding(mesh, P("heads"))))
    print("VMAP_SHARDED", max(float(np.abs(np.asarray(got) - want).max()),
                              float(np.abs(np.asarray(got_o) - np.asarray(jax.jit(fo)(oc))).max())))
    # A decode step as a model runs it: store + attention per layer in a lax.scan, cache sharded by kv heads.
    layers = 2
    kvl = r((b * mp + 2, 2, layers, page, hkv, d))
    q1, k1 = r((b, h, d)), r((b, hkv, d))
    o1 = np.arange(b + 1, dtype=np.int32)

    def step(kv, q, k):
        def body(carry, layer):
            kv, x = carry
            kv = msa_ops.kv_cache_store_ragged_paged(kv, k, k, o1, cl, lut, layer, implementation=impl)
            return (kv, x + msa_ops.mha_ragged_paged(x, o1, kv, cl, lut, layer, implementation=impl)), None
        return jax.lax.scan(body, (kv, q), jnp.arange(layers, dtype=jnp.int32))[0]

    want = [np.asarray(w) for w in jax.jit(step)(kvl, q1, k1)]
    with jax.set_mesh(mesh):
        put = lambda x, ax: jax.device_put(x, NamedSharding(mesh, P(*["heads" if i == ax else None
                                                                      for i in range(x.ndim)])))
        args = (put(kvl, 4), put(q1, 1), put(k1, 1))
        got = jax.jit(step)(*args)
        text = jax.jit(step).lower(*args).compile().as_text()
    err = max(float(np.abs(np.asarray(g) - w).max()) for g, w in zip(got, want))
    print("CASE scan_decode_step", err, "heads" in str(got[1].sharding.spec), "all-gather" in text)
''')


def _run_explicit(impl: str) -> dict:
    out = _run(impl, EXPLICIT)
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("CASE", "FALLBACK"))]
    res = {row[1]: (float(row[2]), row[3] == "True", row[4] == "True") for row in rows if row[0] == "CASE"}
    res["fallback"] = next(float(row[1]) for row in rows if row[0] == "FALLBACK")
    res["vmap_sharded"] = next(float(ln.split()[1]) for ln in out.splitlines() if ln.startswith("VMAP_SHARDED"))
    return res


def _check_explicit(res: dict) -> None:
    assert res.pop("fallback") < 1e-5, res
    assert res.pop("vmap_sharded") < 1e-5, res
    assert len(res) == 8, res
    for name, (err, head_sharded, gathered) in res.items():
        assert err < 1e-5, (name, err)
        assert head_sharded, f"{name}: output lost its head sharding"
        assert not gathered, f"{name}: the compiled program gathers an operand"


def test_explicit_head_sharding_reference():
    _check_explicit(_run_explicit("reference"))


def test_explicit_head_sharding_native():
    import pytest

    from msa_ops import _native

    if not _native.available("cpu"):
        pytest.skip("native CPU library not available")
    _check_explicit(_run_explicit("native"))
