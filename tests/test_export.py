"""Cross-lowering: every op lowers to its native FFI custom call for CUDA (and CPU) with typed attributes,
checked on the module text of ``jax.export`` run on this (CPU-only) machine."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

import msa_ops

SDS = jax.ShapeDtypeStruct
I32 = jnp.int32
BF = jnp.bfloat16
F8 = jnp.float8_e4m3fn

T, H, HKV, D, P, NB, L, B, MP = 8, 8, 2, 64, 16, 12, 2, 4, 4
PAGED = (SDS((T, H, D), BF), SDS((B + 1,), I32), SDS((NB, 2, L, P, HKV, D), BF), SDS((B,), I32),
         SDS((B, MP), I32), SDS((), I32))
MSA_KV = SDS((NB, 2, L, 128, HKV, 128), BF)
MSA = (SDS((T, H, 128), BF), SDS((B + 1,), I32), SDS((B + 1,), I32), MSA_KV, SDS((B,), I32), SDS((B, MP), I32),
       SDS((), I32), SDS((HKV, T, 4), I32))

CASES = {
    "mha_ragged_paged": (
        "msa_ops_mha_ragged_paged",
        lambda *a: msa_ops.mha_ragged_paged(*a, mask_str="sliding_window_causal", local_window_size=5,
                                            num_partitions=3, implementation="native"),
        PAGED,
        {"mask": ("2", "i64"), "window": ("5", "i64"), "scale": (None, "f64"), "has_sink": ("0", "i64"),
         "num_partitions": ("3", "i64"), "block_n": ("64", "i64")},
    ),
    "mha_ragged_paged_sink": (
        "msa_ops_mha_ragged_paged",
        lambda *a: msa_ops.mha_ragged_paged(*a[:-1], sink_weights=a[-1], mask_str="causal",
                                            implementation="native"),
        PAGED + (SDS((H,), BF),),
        {"mask": ("1", "i64"), "has_sink": ("1", "i64"), "scale": (None, "f64")},
    ),
    "mha_padded_paged": (
        "msa_ops_mha_padded_paged",
        lambda q, kv, c, lut, layer, vl: msa_ops.mha_padded_paged(q, kv, c, lut, layer, vl, mask_str="null",
                                                                   scale=0.5, implementation="native"),
        (SDS((B, 2, H, D), BF), PAGED[2], PAGED[3], PAGED[4], PAGED[5], SDS((B,), I32)),
        {"mask": ("0", "i64"), "scale": ("5.000000e-01", "f64"), "num_partitions": (None, "i64")},
    ),
    "mha_ragged_no_cache": (
        "msa_ops_mha_ragged_no_cache",
        lambda *a: msa_ops.mha_ragged_no_cache(*a, mask_str="chunked_causal", local_window_size=4,
                                               implementation="native"),
        (SDS((T, H, D), BF), SDS((T, HKV, D), BF), SDS((T, HKV, D), BF), SDS((B + 1,), I32), SDS((B + 1,), I32)),
        {"mask": ("4", "i64"), "window": ("4", "i64"), "scale": (None, "f64")},
    ),
    "mha_padded_no_cache": (
        "msa_ops_mha_padded_no_cache",
        lambda *a: msa_ops.mha_padded_no_cache(*a, mask_str="sliding_window_noncausal", local_window_size=3,
                                               implementation="native"),
        (SDS((B, 3, H, D), BF), SDS((B, 3, HKV, D), BF), SDS((B, 3, HKV, D), BF), SDS((B,), I32)),
        {"mask": ("3", "i64"), "window": ("3", "i64")},
    ),
    "get_num_partitions": (
        "msa_ops_get_num_partitions",
        lambda b, n: msa_ops.mha_decode_get_num_partitions(b, n, n_kv_heads=8, sm_count=132,
                                                           implementation="native"),
        (SDS((), I32), SDS((), I32)),
        {"n_kv_heads": ("8", "i64"), "sm_count": ("132", "i64")},
    ),
    "msa_attention": (
        "msa_ops_msa_attention",
        lambda *a: msa_ops.msa_attention_ragged_paged(*a, num_partitions=2, implementation="native"),
        MSA,
        {"num_partitions": ("2", "i64"), "scale": (None, "f64")},
    ),
    "msa_attention_fp8": (
        "msa_ops_msa_attention",
        lambda *a: msa_ops.msa_attention_ragged_paged(*a, implementation="native"),
        (SDS((T, H, 128), F8),) + MSA[1:3] + (SDS(MSA_KV.shape, F8),) + MSA[4:],
        {"scale": (None, "f64")},
    ),
    "msa_indexer": (
        "msa_ops_msa_indexer",
        lambda *a: msa_ops.msa_indexer_ragged_paged(*a, topk=4, init_blocks=1, local_blocks=2,
                                                    implementation="native"),
        (SDS((T, 4, 64), BF), SDS((B + 1,), I32), SDS((NB, 1, L, 128, 1, 64), BF), SDS((B,), I32),
         SDS((B, MP), I32), SDS((), I32)),
        {"topk": ("4", "i64"), "init_blocks": ("1", "i64"), "local_blocks": ("2", "i64"), "scale": (None, "f64")},
    ),
    "kv_cache_store": (
        "msa_ops_kv_cache_store",
        lambda kv, k, v, o, c, lut, layer: msa_ops.kv_cache_store_ragged_paged(kv, k, v, o, c, lut, layer,
                                                                               implementation="native"),
        (PAGED[2], SDS((T, HKV, D), BF), SDS((T, HKV, D), BF), SDS((B + 1,), jnp.uint32), SDS((B,), jnp.uint32),
         SDS((B, MP), jnp.uint32), SDS((), I32)),
        {},
    ),
    "kv_cache_row_offsets": (
        "msa_ops_kv_cache_row_offsets",
        lambda o, c: msa_ops.kv_cache_row_offsets_ragged_paged(o, c, implementation="native"),
        (SDS((B + 1,), I32), SDS((B,), I32)),
        {},
    ),
}


def _lower(target, fn, args, platform):
    with msa_ops.assume_native(platform):
        # A fresh function object: lowerings are cached per traced function, and assume_native only
        # affects lowerings made inside the context.
        exp = export.export(
            jax.jit(lambda *a: fn(*a)), platforms=[platform],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(target)],
        )(*args)
    return exp.mlir_module()


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_lowers_to_custom_call_with_typed_attrs(case, platform):
    target, fn, args, attrs = CASES[case]
    text = _lower(target, fn, args, platform)
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call" in ln]
    ours = [ln for ln in calls if f"@{target}(" in ln]
    assert len(ours) == 1, calls
    line = ours[0]
    assert "api_version = 4" in line or "mhlo.backend_config = {" in line
    for name, (value, ty) in attrs.items():
        m = re.search(rf"\b{name} = ([^ ,}}]+) : (\w+)", line)
        assert m, f"attribute {name} missing in {line[:400]}"
        assert m.group(2) == ty, (name, m.group(2))
        if value is not None:
            assert m.group(1) == value, (name, m.group(1))
    # integer operands reach the handler as int32
    assert "ui32" not in line.split("->")[0].split(":")[-1]
    if case == "kv_cache_store":
        assert "output_operand_aliases" in line


@pytest.fixture
def no_cuda_library(monkeypatch):
    """A process without the CUDA library (CI's machine); on a GPU machine that has it, the library is hidden."""
    from msa_ops import _native

    real = _native.available
    monkeypatch.setattr(_native, "available", lambda p: p not in ("cuda", "gpu") and real(p))


def test_auto_lowers_to_reference_without_library(no_cuda_library):
    # No CUDA library loaded: 'auto' picks the reference lowering for CUDA.
    target, fn, args, _ = CASES["mha_ragged_paged"]
    exp = export.export(
        jax.jit(lambda *a: msa_ops.mha_ragged_paged(*a, mask_str="causal")), platforms=["cuda"]
    )(*args)
    assert f"@{target}" not in exp.mlir_module()


def test_native_without_library_raises_clear_error(no_cuda_library):
    _, fn, args, _ = CASES["mha_ragged_paged"]
    with pytest.raises(msa_ops.NativeUnavailableError, match=r"mo\.mha\.ragged\.paged.*native.*cuda"):
        export.export(jax.jit(lambda *a: fn(*a)), platforms=["cuda"])(*args)


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_indexer_score_workspace_only_on_cuda(platform):
    """The CUDA indexer returns its per-block scores as a second (workspace) result; the op itself has one."""
    target, fn, args, _ = CASES["msa_indexer"]
    line = next(ln for ln in _lower(target, fn, args, platform).splitlines() if f"@{target}(" in ln)
    results = line.split("->")[-1]
    mp = args[4].shape[1]
    assert ("tensor<4x" in results) and ((f"x{mp}xf32>" in results) == (platform == "cuda")), results


def test_indexer_cuda_coverage_rules():
    from msa_ops.ops.msa import _ix_native_supports

    def reason(di, dtype, mp):
        q = SDS((T, 4, di), dtype)
        kb = SDS((3, 1, 1, 128, 1, di), dtype)
        lut = SDS((B, mp), I32)
        return _ix_native_supports(q, None, kb, None, lut, None, attrs=None, platform="cuda")

    assert reason(128, BF, 1024) is None and reason(64, jnp.float32, 8) is None
    assert reason(128, jnp.float8_e4m3fn, 8) is None and reason(8, BF, 8) is None
    assert "16, 32, ..., 512 bytes" in reason(96, BF, 8)  # 192-byte rows
    assert "16, 32, ..., 512 bytes" in reason(512, BF, 8)  # 1024-byte rows
    assert "max_pages <= 8192" in reason(128, BF, 8193)
    q = SDS((T, 4, 96), BF)
    assert _ix_native_supports(q, None, None, None, SDS((B, 8), I32), None, attrs=None, platform="cpu") is None


def test_serialized_export_runs_the_native_handlers():
    """A decode step (store, dense attention, indexer, sparse attention) exported with the native lowering for the
    CPU and CUDA and called (and, where flatbuffers is installed, serialized and deserialized first): the same bits
    as the jitted step, which matches the oracle. Without export_safety_checks() jax refuses to export the custom
    calls."""
    from msa_ops import _native

    if not _native.available("cpu"):
        pytest.skip(f"native CPU library not available: {_native.missing_reason('cpu')}")
    import numpy as np
    import oracle
    from conftest import assert_close, budget_for, on_cpu, rand

    rng = np.random.default_rng(3)
    b, hkv, group, mp, nb = 2, 2, 4, 3, 8
    kv = rand(rng, (nb, 2, 1, 128, hkv, 128), BF)
    kb = rand(rng, (nb, 1, 1, 128, 1, 64), BF)
    lut = rng.permutation(nb)[: b * mp].reshape(b, mp).astype(np.int32)
    cl = np.array([300, 129], np.int32)
    offs = np.array([0, 1, 2], np.int32)
    q = rand(rng, (b, hkv * group, 128), BF)
    iq = rand(rng, (b, 4, 64), BF)
    k_new, v_new = rand(rng, (b, hkv, 128), BF), rand(rng, (b, hkv, 128), BF)

    def step(kv, q, iq, k_new, v_new, offs, cl, lut, kb):
        kv = msa_ops.kv_cache_store_ragged_paged(kv, k_new, v_new, offs, cl, lut, 0, implementation="native")
        dense = msa_ops.mha_ragged_paged(q, offs, kv, cl + 1, lut, 0, mask_str="causal", implementation="native")
        sel = msa_ops.msa_indexer_ragged_paged(iq, offs, kb, cl + 1, lut, 0, topk=2, init_blocks=1,
                                               implementation="native")
        sparse = msa_ops.msa_attention_ragged_paged(q, offs, None, kv, cl + 1, lut, 0, sel[:hkv],
                                                    implementation="native")
        return dense, sel, sparse

    args = (kv, q, iq, k_new, v_new, offs, cl, lut, kb)
    jitted = jax.jit(step)
    with msa_ops.assume_native("cuda"):
        with pytest.raises(ValueError, match="custom calls"):
            export.export(jitted, platforms=["cpu", "cuda"])(*args)
        exp = export.export(jitted, platforms=["cpu", "cuda"], disabled_checks=msa_ops.export_safety_checks())(*args)
    text = exp.mlir_module()
    for target in ("msa_ops_kv_cache_store", "msa_ops_mha_ragged_paged", "msa_ops_msa_indexer",
                   "msa_ops_msa_attention"):
        assert f"@{target}(" in text, target
    try:  # serialization needs flatbuffers, which jax does not require
        import flatbuffers  # noqa: F401

        exps = [exp, export.deserialize(exp.serialize())]
    except ImportError:
        exps = [exp]
    with on_cpu():
        want = [np.asarray(x) for x in jitted(*args)]
        for e in exps:
            got = [np.asarray(x) for x in e.call(*args)]
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)
    kv_new = oracle.kv_cache_store_ragged_paged(kv, k_new, v_new, offs, cl, lut, 0)
    assert_close(got[0], oracle.mha_ragged_paged(q, offs, kv_new, cl + 1, lut, 0), budget_for(BF))
