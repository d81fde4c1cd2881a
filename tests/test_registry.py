"""The registry surface: names, definitions, call-by-name, implementation selection."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msa_ops

NAMES = {
    "mo.mha.ragged.paged", "mo.mha.ragged.paged.sink_weights", "mo.mha.padded.paged", "mo.mha.ragged.no_cache",
    "mo.mha.padded.no_cache", "mo.mha.decode.get_num_partitions", "mo.msa.attention.ragged.paged",
    "mo.msa.indexer.ragged.paged", "mo.kv_cache.store.ragged.paged", "mo.kv_cache.row_offsets.ragged.paged",
}


def test_list_ops_names_every_spec_op():
    assert set(msa_ops.list_ops()) == NAMES


@pytest.mark.parametrize("name", sorted(NAMES))
def test_get_op_definition(name):
    op = msa_ops.get_op(name)
    assert op.name == name
    assert op.primitive.name == name
    assert callable(op.abstract) and callable(op.reference) and callable(op.batching)
    assert op.ffi_target and op.ffi_target.startswith("msa_ops_")
    assert len(op.operands) >= 2


def _paged_case(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    t, h, hkv, d, p, nb, nl = 7, 4, 2, 32, 8, 9, 2
    q = jnp.asarray(rng.standard_normal((t, h, d)), dtype)
    kv = jnp.asarray(rng.standard_normal((nb, 2, nl, p, hkv, d)), dtype)
    off = jnp.array([0, 3, 3, 7], jnp.int32)
    cl = jnp.array([5, 2, 12], jnp.int32)
    lut = jnp.asarray(rng.permutation(nb)[:9].reshape(3, 3), jnp.int32)
    return q, off, kv, cl, lut, jnp.int32(1)


def test_call_by_name_equals_wrapper():
    args = _paged_case()
    a = msa_ops.call("mo.mha.ragged.paged", *args, mask_str="causal", implementation="reference")
    b = msa_ops.mha_ragged_paged(*args, implementation="reference")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    sink = jnp.linspace(-1, 1, 4, dtype=jnp.float32)
    c = msa_ops.call("mo.mha.ragged.paged.sink_weights", *args, sink, mask_str="causal", implementation="reference")
    d = msa_ops.mha_ragged_paged(*args, sink_weights=sink, implementation="reference")
    np.testing.assert_array_equal(np.asarray(c), np.asarray(d))
    assert not np.allclose(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize("transform", ["grad", "jvp"])
def test_no_differentiation_rule(transform):
    """README: inference ops; differentiating through one raises JAX's NotImplementedError naming the op."""
    q, *rest = _paged_case()

    def f(x):
        return msa_ops.mha_ragged_paged(x, *rest).sum()

    with pytest.raises(NotImplementedError, match="mo.mha.ragged.paged"):
        if transform == "grad":
            jax.grad(f)(q)
        else:
            jax.jvp(f, (q,), (q,))


def test_mask_aliases_with_mask_suffix():
    args = _paged_case()
    a = msa_ops.mha_ragged_paged(*args, mask_str="causal_mask", implementation="reference")
    b = msa_ops.mha_ragged_paged(*args, mask_str="causal", implementation="reference")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_uint32_integers_accepted():
    q, off, kv, cl, lut, layer = _paged_case()
    a = msa_ops.mha_ragged_paged(q, off, kv, cl, lut, layer, implementation="reference")
    b = msa_ops.mha_ragged_paged(q, off.astype(jnp.uint32), kv, cl.astype(jnp.uint32), lut.astype(jnp.uint32),
                                 layer.astype(jnp.uint32), implementation="reference")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hints_do_not_change_results():
    args = _paged_case()
    a = jax.jit(lambda *x: msa_ops.mha_ragged_paged(*x, implementation="reference"))(*args)
    b = jax.jit(lambda *x: msa_ops.mha_ragged_paged(*x, implementation="reference", max_prompt_length=1,
                                                    max_cache_length=3, total_context_length=5))(*args)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_environment_forces_reference(monkeypatch):
    monkeypatch.setenv(msa_ops.IMPLEMENTATION_ENV, "reference")
    op = msa_ops.get_op("mo.mha.ragged.paged")
    assert msa_ops.resolve_implementation(op, "cpu", "auto") == "reference"
    monkeypatch.setenv(msa_ops.IMPLEMENTATION_ENV, "bogus")
    with pytest.raises(msa_ops.OpAttributeError, match="MSA_OPS_IMPLEMENTATION"):
        msa_ops.resolve_implementation(op, "cpu", "auto")


def test_native_on_unknown_platform_raises():
    op = msa_ops.get_op("mo.mha.ragged.paged")
    with pytest.raises(msa_ops.NativeUnavailableError, match="mo.mha.ragged.paged"):
        msa_ops.resolve_implementation(op, "tpu", "native")
    assert msa_ops.resolve_implementation(op, "tpu", "auto") == "reference"


def test_eager_and_jit_agree():
    args = _paged_case()
    a = msa_ops.mha_ragged_paged(*args, implementation="reference")
    b = jax.jit(lambda *x: msa_ops.mha_ragged_paged(*x, implementation="reference"))(*args)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_store_in_place_when_donated():
    q, off, kv, cl, lut, layer = _paged_case()
    k = q[:, :2]
    v = q[:, 2:]
    f = jax.jit(lambda kv, k, v: msa_ops.kv_cache_store_ragged_paged(kv, k, v, off, cl, lut, layer),
                donate_argnums=0)
    ptr = kv.unsafe_buffer_pointer()
    out = f(kv, k, v)
    assert out.unsafe_buffer_pointer() == ptr


def test_info_reports_built_libraries():
    import re

    from msa_ops import _native

    info = _native.info()["platforms"]
    if info["cpu"]["library"] is None:
        pytest.skip("native libraries not built")
    assert info["cpu"]["available"], info["cpu"]["reason"]
    assert set(_native.TARGETS) <= set(info["cpu"]["registered_targets"])
    if info["cuda"]["library"] is not None:  # compiled here (nvcc present) even without a GPU
        assert re.fullmatch(r"\d+a?(;\d+a?)*", info["cuda"]["archs"] or ""), info["cuda"]


def test_cli_bench_forwards_its_arguments(capsys):
    """`python -m msa_ops bench ARGS` hands ARGS to benchmarks/cpu_bench.py (its --help here; the script is found
    from the source tree or, for an installed package, the working directory: the tests run from the checkout);
    other subcommands reject arguments they do not take."""
    from msa_ops.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0 and "--cache" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["info", "--cache", "5"])
    assert e.value.code == 2 and "unrecognized arguments: --cache 5" in capsys.readouterr().err


def test_call_operand_count_says_what_may_be_left_out():
    """A wrong operand count names the op, the operands, and those SPEC.md lets a caller omit."""
    x = np.zeros((1,), np.int32)
    with pytest.raises(msa_ops.OpShapeError, match=r"^mo\.msa\.attention\.ragged\.paged: expected 8 operands "
                       r"\(q, .*, d_indices\), got 6; cache_row_offsets may be left out$"):
        msa_ops.call("mo.msa.attention.ragged.paged", *[x] * 6)
    with pytest.raises(msa_ops.OpShapeError, match=r"^mo\.mha\.ragged\.no_cache: expected 5 operands .*, got 3; "
                       r"kv_input_row_offsets may be left out$"):
        msa_ops.call("mo.mha.ragged.no_cache", x, x, x)
    with pytest.raises(msa_ops.OpShapeError, match=r"^mo\.mha\.ragged\.paged: expected 6 operands .*, got 5$"):
        msa_ops.call("mo.mha.ragged.paged", *[x] * 5)
    with pytest.raises(msa_ops.OpShapeError, match=r"operand 'layer_idx': expected an array, got None"):
        msa_ops.call("mo.mha.ragged.paged", *[x] * 5, None, mask_str="causal")


def test_plan_takes_the_omitted_operands_too():
    """msa_ops.plan reads the same operand list as msa_ops.call: cache_row_offsets given, None or left out."""
    S = jax.ShapeDtypeStruct
    q, offs, kv = S((4, 32, 128), jnp.bfloat16), S((5,), jnp.int32), S((9, 2, 1, 128, 4, 128), jnp.bfloat16)
    rest = (S((4,), jnp.int32), S((4, 3), jnp.int32), S((), jnp.int32), S((4, 4, 16), jnp.int32))
    name = "mo.msa.attention.ragged.paged"
    given = msa_ops.plan(name, q, offs, offs, kv, *rest)
    assert msa_ops.plan(name, q, offs, None, kv, *rest) == given
    assert msa_ops.plan(name, q, offs, kv, *rest) == given
    with pytest.raises(msa_ops.OpDtypeError, match=r"operand 'cache_lengths': expected dtype int32 or uint32"):
        msa_ops.plan(name, q, offs, kv, S((4,), jnp.float32), *rest[1:])


def test_a_forgotten_operand_error_says_how_the_operands_were_read():
    """One operand short reads as the optional operand left out; when it was a required one that was forgotten,
    the error of the operand after it says how the call's operands were read."""
    S = jax.ShapeDtypeStruct
    q, offs, kv = S((4, 4, 128), jnp.bfloat16), S((3,), jnp.int32), S((5, 2, 1, 128, 2, 128), jnp.bfloat16)
    cl, lut, d = S((2,), jnp.int32), S((2, 2), jnp.int32), S((2, 4, 3), jnp.int32)
    name = "mo.msa.attention.ragged.paged"
    for run in (lambda *a: jax.eval_shape(lambda *b: msa_ops.call(name, *b), *a), lambda *a: msa_ops.plan(name, *a)):
        with pytest.raises(msa_ops.OpShapeError, match=r"^mo\.msa\.attention\.ragged\.paged: operand 'cache_lengths'"
                           r".*\[7 operands were read as q, input_row_offsets, kv_blocks, cache_lengths, "
                           r"kv_lookup_table, layer_idx, d_indices, with cache_row_offsets left out; the op takes 8: "):
            run(q, offs, offs, kv, cl, lut, d)  # layer_idx forgotten
    # All operands given: no such note.
    with pytest.raises(msa_ops.OpShapeError) as ei:
        msa_ops.plan(name, q, offs, offs, kv, cl, lut, S((2,), jnp.int32), d)
    assert "were read as" not in str(ei.value) and "operand 'layer_idx'" in str(ei.value)


@pytest.mark.parametrize("bad", [None, "x", {"a": 1}])
def test_plan_names_an_operand_that_is_not_an_array(bad):
    x = jax.ShapeDtypeStruct((3,), jnp.int32)
    with pytest.raises(msa_ops.OpShapeError, match=r"^mo\.mha\.ragged\.paged: operand 'q': expected an array"):
        msa_ops.plan("mo.mha.ragged.paged", bad, x, x, x, x, x, mask_str="causal")


def test_python_int_operands_are_int32_under_x64():
    """jax_enable_x64 makes a Python int int64, which the ops refuse; an int passed as an operand reads as int32
    (uint32 past 2^31 - 1) either way. Explicit int64 arrays are still refused. In a child process: x64 is global."""
    import subprocess
    import sys
    import textwrap

    from conftest import child_env

    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, msa_ops
        assert jax.config.jax_enable_x64
        print("parts", int(msa_ops.mha_decode_get_num_partitions(3, 4096, n_kv_heads=2, sm_count=132)))
        print("parts_u32", int(msa_ops.mha_decode_get_num_partitions(3, 2**31 + 5, n_kv_heads=2, sm_count=132)))
        i32 = jnp.int32
        q = jnp.ones((5, 4, 16), jnp.bfloat16)
        kv = jnp.ones((9, 2, 2, 4, 2, 16), jnp.bfloat16)
        args = (q, jnp.array([0, 2, 5], i32), kv, jnp.array([3, 6], i32), jnp.zeros((2, 4), i32))
        out = msa_ops.mha_ragged_paged(*args, 1, mask_str="causal")
        print("shape", out.shape, out.dtype)
        try:
            msa_ops.mha_ragged_paged(*args, jnp.asarray(1, jnp.int64), mask_str="causal")
        except msa_ops.OpDtypeError as e:
            print("refused", e)
    """)
    env = child_env(JAX_ENABLE_X64="1")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == f"parts {msa_ops.mha_decode_get_num_partitions(3, 4096, n_kv_heads=2, sm_count=132)}", lines
    assert lines[1].startswith("parts_u32 "), lines
    assert lines[2] == "shape (5, 4, 16) bfloat16", lines
    assert lines[3].startswith("refused mo.mha.ragged.paged: operand 'layer_idx': expected dtype int32"), lines
