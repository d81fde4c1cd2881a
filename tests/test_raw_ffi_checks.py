"""Direct FFI calls with one buffer or attribute out of contract (docs/SEMANTICS.md, "Native (XLA FFI) contract"):
each handler must return an error naming the target and the operand before any kernel reads or writes through a
size the buffers do not have. The same cases run against the CPU library here and the CUDA library under
``pytest -m gpu`` (the checks are one header, kernels/include/msa_ops/checks.h, that both handlers call).

Each case changes one thing in a call that both platforms accept (bf16, head dims the CUDA kernels take); the
unchanged calls are run first and must succeed. (A call whose every result is empty, as with no query heads or a
page size of 0 in the store, never reaches a handler: XLA elides it.)
"""

from __future__ import annotations

import re

import jax
import ml_dtypes
import numpy as np
import pytest

import msa_ops
from msa_ops import _native
from msa_ops.errors import OpShapeError

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
I32, I16, I8 = np.dtype(np.int32), np.dtype(np.int16), np.dtype(np.int8)

PLATFORMS = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]

T, B, H, HKV, D, NB, L, P, MP, NP, S = 6, 2, 4, 2, 64, 6, 2, 16, 3, 2, 3
OFFS = np.array([0, 2, 5], np.int32)


def _arr(rng, shape, dt):
    if np.dtype(dt).kind in "iu":
        return np.zeros(shape, dt)
    return (rng.standard_normal(shape) * 0.5).astype(np.float32).astype(dt)


def _bases(platform):
    """target, operands (name -> array, in order), attributes, results (name -> (shape, dtype)) of calls that every
    platform accepts."""
    rng = np.random.default_rng(0)
    kv = _arr(rng, (NB, 2, L, P, HKV, D), BF16)
    lut = np.arange(B * MP, dtype=np.int32).reshape(B, MP)
    cl = np.array([3, 7], np.int32)
    msa_kv = _arr(rng, (4, 2, L, 128, HKV, 128), BF16)
    msa_lut = np.array([[0, 1], [2, 3]], np.int32)
    bases = {
        "rp": ("msa_ops_mha_ragged_paged",
               dict(q=_arr(rng, (T, H, D), BF16), input_row_offsets=OFFS, kv_blocks=kv, cache_lengths=cl,
                    kv_lookup_table=lut, layer_idx=np.int32(1), sink_weights=_arr(rng, (H,), BF16)),
               dict(mask=1, window=-1, scale=0.125, has_sink=1, num_partitions=NP, block_n=64, tile_m=16),
               dict(out=((T, H, D), BF16), ws_o=((NP, T, H, D), F32), ws_lse=((NP, T, H), F32))),
        "pp": ("msa_ops_mha_padded_paged",
               dict(q=_arr(rng, (B, S, H, D), BF16), kv_blocks=kv, cache_lengths=cl, kv_lookup_table=lut,
                    layer_idx=np.int32(0), valid_lengths=np.array([2, 3], np.int32)),
               dict(mask=1, window=-1, scale=0.125, num_partitions=NP, block_n=64, tile_m=16),
               dict(out=((B, S, H, D), BF16), ws_o=((NP, B * S, H, D), F32), ws_lse=((NP, B * S, H), F32))),
        "rn": ("msa_ops_mha_ragged_no_cache",
               dict(q=_arr(rng, (T, H, D), BF16), k=_arr(rng, (T + 2, HKV, D), BF16),
                    v=_arr(rng, (T + 2, HKV, D), BF16), input_row_offsets=OFFS,
                    kv_input_row_offsets=np.array([0, 3, 8], np.int32)),
               dict(mask=1, window=-1, scale=0.125), dict(out=((T, H, D), BF16))),
        "pn": ("msa_ops_mha_padded_no_cache",
               dict(q=_arr(rng, (B, S, H, D), BF16), k=_arr(rng, (B, 5, HKV, D), BF16),
                    v=_arr(rng, (B, 5, HKV, D), BF16), valid_length=np.array([2, 3], np.int32)),
               dict(mask=1, window=-1, scale=0.125), dict(out=((B, S, H, D), BF16))),
        "msa": ("msa_ops_msa_attention",
                dict(q=_arr(rng, (T, H, 128), BF16), input_row_offsets=OFFS,
                     cache_row_offsets=np.array([0, 5, 15], np.int32), kv_blocks=msa_kv, cache_lengths=cl,
                     kv_lookup_table=msa_lut, layer_idx=np.int32(1), d_indices=np.zeros((HKV, T, 4), np.int32)),
                dict(scale=0.088, num_partitions=NP, max_q=3),
                dict(out=((T, H, 128), BF16), ws_o=((NP, T, H, 128), F32), ws_lse=((NP, T, H), F32))),
        "ix": ("msa_ops_msa_indexer",
               dict(q=_arr(rng, (T, 2, 32), BF16), input_row_offsets=OFFS,
                    k_blocks=_arr(rng, (4, 1, L, 128, 1, 32), BF16), k_cache_lengths=cl, k_lookup_table=msa_lut,
                    layer_idx=np.int32(1)),
               dict(topk=3, init_blocks=1, local_blocks=1, scale=0.2),
               dict(out=((2, T, 3), I32))),
        "st": ("msa_ops_kv_cache_store",
               dict(kv_blocks=kv, k=_arr(rng, (T, HKV, D), BF16), v=_arr(rng, (T, HKV, D), BF16),
                    input_row_offsets=OFFS, cache_lengths=cl, kv_lookup_table=lut, layer_idx=np.int32(1)),
               {}, dict(out=((NB, 2, L, P, HKV, D), BF16))),
        "ro": ("msa_ops_kv_cache_row_offsets", dict(input_row_offsets=OFFS, cache_lengths=cl), {},
               dict(out=((B + 1,), I32))),
        "gp": ("msa_ops_get_num_partitions", dict(batch=np.int32(2), max_cache_valid_length=np.int32(4096)),
               dict(n_kv_heads=8, sm_count=132), dict(out=((), I32))),
    }
    if platform == "cuda":  # the CUDA indexer's score workspace [T, Hi, MP]
        bases["ix"][3]["scores"] = ((T, 2, 2), F32)
    return bases


def _z(shape, dt):
    return np.zeros(shape, dt)


def _f(shape, dt):
    return np.full(shape, 0.25, dt)


# (id, base, operands, attributes, results, the operand the error must name)
CASES = [
    ("rp-q-rank4-empty", "rp", dict(q=_f((T, H, D, 0), BF16)), {}, {}, "q"),
    ("rp-q-f16", "rp", dict(q=_f((T, H, D), F16)), {}, {}, "kv_blocks"),
    ("rp-offsets-int16", "rp", dict(input_row_offsets=OFFS.astype(np.int16)), {}, {}, "input_row_offsets"),
    ("rp-cache-lengths-short", "rp", dict(cache_lengths=np.array([3], np.int32)), {}, {}, "input_row_offsets"),
    ("rp-cache-lengths-int8", "rp", dict(cache_lengths=np.array([3, 7], np.int8)), {}, {}, "cache_lengths"),
    ("rp-kv-fp8", "rp", dict(kv_blocks=_f((NB, 2, L, P, HKV, D), FP8)), {}, {}, "kv_blocks"),
    ("rp-kv-page0", "rp", dict(kv_blocks=_f((NB, 2, L, 0, HKV, D), BF16)), {}, {}, "kv_blocks"),
    ("rp-kv-head-dim", "rp", dict(kv_blocks=_f((NB, 2, L, P, HKV, 32), BF16)), {}, {}, "kv_blocks"),
    ("rp-kv-heads-3", "rp", dict(kv_blocks=_f((NB, 2, L, P, 3, D), BF16)), {}, {}, "kv_blocks"),
    ("rp-lut-int16", "rp", dict(kv_lookup_table=_z((B, MP), I16)), {}, {}, "kv_lookup_table"),
    ("rp-lut-rank3-empty", "rp", dict(kv_lookup_table=_z((B, MP, 0), I32)), {}, {}, "kv_lookup_table"),
    ("rp-lut-rows", "rp", dict(kv_lookup_table=_z((B + 1, MP), I32)), {}, {}, "kv_lookup_table"),
    ("rp-layer-empty", "rp", dict(layer_idx=_z((0,), I32)), {}, {}, "layer_idx"),
    ("rp-layer-int8", "rp", dict(layer_idx=np.int8(1)), {}, {}, "layer_idx"),
    ("rp-sink-short", "rp", dict(sink_weights=_f((1,), BF16)), {}, {}, "sink_weights"),
    ("rp-sink-fp8", "rp", dict(sink_weights=_f((H,), FP8)), {}, {}, "sink_weights"),
    ("rp-out-short", "rp", {}, {}, dict(out=((T - 1, H, D), BF16)), "out"),
    ("rp-out-fp8", "rp", {}, {}, dict(out=((T, H, D), FP8)), "out"),
    ("rp-ws-o-heads", "rp", {}, {}, dict(ws_o=((NP, T, 1, 1), F32)), "ws_o"),
    ("rp-ws-o-bf16", "rp", {}, {}, dict(ws_o=((NP, T, H, D), BF16)), "ws_o"),
    ("rp-ws-lse-rank1", "rp", {}, {}, dict(ws_lse=((NP,), F32)), "ws_lse"),
    ("rp-num-partitions-0", "rp", {}, dict(num_partitions=0), {}, "num_partitions"),
    # head dim 0 leaves q empty whatever T and H are: 8 * T * H = 2^64 + 8 wrapped onto 8 workspace entries
    ("rp-ws-count-wraps", "rp", dict(q=_f((2**61 + 1, 1, 0), BF16), kv_blocks=_f((NB, 2, L, P, 1, 0), BF16),
                                     sink_weights=_f((1,), BF16)), dict(num_partitions=8),
     dict(out=((2**61 + 1, 1, 0), BF16), ws_o=((0,), F32), ws_lse=((8,), F32)), "q, ws_lse"),
    ("rp-block-n-0", "rp", {}, dict(block_n=0), {}, "block_n"),
    ("rp-mask-9", "rp", {}, dict(mask=9), {}, "mask"),
    ("rp-window-0", "rp", {}, dict(mask=2, window=0), {}, "window"),
    ("pp-valid-lengths-short", "pp", dict(valid_lengths=np.array([2], np.int32)), {}, {}, "valid_lengths"),
    ("pp-cache-lengths-short", "pp", dict(cache_lengths=np.array([3], np.int32)), {}, {}, "cache_lengths"),
    ("pp-kv-fp8", "pp", dict(kv_blocks=_f((NB, 2, L, P, HKV, D), FP8)), {}, {}, "kv_blocks"),
    ("pp-layer-empty", "pp", dict(layer_idx=_z((0,), I32)), {}, {}, "layer_idx"),
    ("pp-out-short", "pp", {}, {}, dict(out=((B, S - 1, H, D), BF16)), "out"),
    ("pp-ws-lse-rank1", "pp", {}, {}, dict(ws_lse=((NP,), F32)), "ws_lse"),
    ("rn-kv-fp8", "rn", dict(k=_f((T + 2, HKV, D), FP8), v=_f((T + 2, HKV, D), FP8)), {}, {}, "k, v"),
    ("rn-v-rows", "rn", dict(v=_f((T + 1, HKV, D), BF16)), {}, {}, "v"),
    ("rn-k-rank4-empty", "rn", dict(k=_f((T + 2, HKV, D, 0), BF16), v=_f((T + 2, HKV, D, 0), BF16)), {}, {}, "k"),
    ("rn-kv-offsets-int16", "rn", dict(kv_input_row_offsets=np.array([0, 3, 8], np.int16)), {}, {},
     "kv_input_row_offsets"),
    ("rn-kv-offsets-short", "rn", dict(kv_input_row_offsets=np.array([0, 3], np.int32)), {}, {},
     "kv_input_row_offsets"),
    ("rn-out-short", "rn", {}, {}, dict(out=((T - 1, H, D), BF16)), "out"),
    ("pn-valid-length-short", "pn", dict(valid_length=np.array([2], np.int32)), {}, {}, "valid_length"),
    ("pn-kv-fp8", "pn", dict(k=_f((B, 5, HKV, D), FP8), v=_f((B, 5, HKV, D), FP8)), {}, {}, "k, v"),
    ("pn-k-batch", "pn", dict(k=_f((B + 1, 5, HKV, D), BF16), v=_f((B + 1, 5, HKV, D), BF16)), {}, {}, "k"),
    ("pn-out-short", "pn", {}, {}, dict(out=((B, S - 1, H, D), BF16)), "out"),
    ("msa-q-f16", "msa", dict(q=_f((T, H, 128), F16)), {}, {}, "q"),
    ("msa-kv-fp8", "msa", dict(kv_blocks=_f((4, 2, L, 128, HKV, 128), FP8)), {}, {}, "kv_blocks"),
    ("msa-kv-page-64", "msa", dict(kv_blocks=_f((4, 2, L, 64, HKV, 128), BF16)), {}, {}, "kv_blocks"),
    ("msa-cache-lengths-short", "msa", dict(cache_lengths=np.array([3], np.int32)), {}, {}, "input_row_offsets"),
    ("msa-cache-row-offsets-short", "msa", dict(cache_row_offsets=np.array([0], np.int32)), {}, {},
     "cache_row_offsets"),
    ("msa-layer-empty", "msa", dict(layer_idx=_z((0,), I32)), {}, {}, "layer_idx"),
    ("msa-lut-int16", "msa", dict(kv_lookup_table=_z((B, 2), I16)), {}, {}, "kv_lookup_table"),
    ("msa-d-indices-int16", "msa", dict(d_indices=_z((HKV, T, 4), I16)), {}, {}, "d_indices"),
    ("msa-d-indices-rows", "msa", dict(d_indices=_z((HKV, T - 1, 4), I32)), {}, {}, "d_indices"),
    ("msa-out-short", "msa", {}, {}, dict(out=((T - 1, H, 128), BF16)), "out"),
    ("msa-out-f16", "msa", {}, {}, dict(out=((T, H, 128), F16)), "out"),
    ("msa-ws-o-rows", "msa", {}, {}, dict(ws_o=((NP, 1, H, 128), F32)), "ws_o"),
    ("msa-ws-lse-rank1", "msa", {}, {}, dict(ws_lse=((NP,), F32)), "ws_lse"),
    ("msa-num-partitions-0", "msa", {}, dict(num_partitions=0), {}, "num_partitions"),
    ("ix-k-f16", "ix", dict(k_blocks=_f((4, 1, L, 128, 1, 32), F16)), {}, {}, "k_blocks"),
    ("ix-k-head-dim", "ix", dict(k_blocks=_f((4, 1, L, 128, 1, 16), BF16)), {}, {}, "k_blocks"),
    ("ix-cache-lengths-int8", "ix", dict(k_cache_lengths=np.array([3, 7], np.int8)), {}, {}, "k_cache_lengths"),
    ("ix-layer-empty", "ix", dict(layer_idx=_z((0,), I32)), {}, {}, "layer_idx"),
    ("ix-lut-int16", "ix", dict(k_lookup_table=_z((B, 2), I16)), {}, {}, "k_lookup_table"),
    ("ix-init-local-over-topk", "ix", {}, dict(init_blocks=2, local_blocks=2), {}, "init_blocks"),
    ("ix-init-local-wrap", "ix", {}, dict(init_blocks=2**62, local_blocks=2**62), {}, "init_blocks"),
    ("ix-out-short", "ix", {}, {}, dict(out=((2, T - 1, 3), I32)), "out"),
    ("ix-out-int8", "ix", {}, {}, dict(out=((2, T, 3), I8)), "out"),
    # topk past int32 (the CUDA handler holds it in an int): the output cannot have that many entries
    ("ix-topk-past-int32", "ix", {}, dict(topk=2**32 + 3, init_blocks=0, local_blocks=0), {}, "out"),
    ("st-k-fp8", "st", dict(k=_f((T, HKV, D), FP8), v=_f((T, HKV, D), FP8)), {}, {}, "k, v"),
    ("st-k-heads", "st", dict(k=_f((T, 1, D), BF16), v=_f((T, 1, D), BF16)), {}, {}, "k"),
    ("st-v-rows", "st", dict(v=_f((T - 1, HKV, D), BF16)), {}, {}, "v"),
    ("st-offsets-short", "st", dict(input_row_offsets=np.array([0, 2], np.int32)), {}, {}, "input_row_offsets"),
    ("st-lut-int16", "st", dict(kv_lookup_table=_z((B, MP), I16)), {}, {}, "kv_lookup_table"),
    ("st-layer-empty", "st", dict(layer_idx=_z((0,), I32)), {}, {}, "layer_idx"),
    ("st-out-shape", "st", {}, {}, dict(out=((NB - 1, 2, L, P, HKV, D), BF16)), "result"),
    ("ro-out-short", "ro", {}, {}, dict(out=((B,), I32)), "out"),
    ("ro-cache-lengths-int8", "ro", dict(cache_lengths=np.array([3, 7], np.int8)), {}, {}, "cache_lengths"),
    ("gp-batch-int16", "gp", dict(batch=np.int16(2)), {}, {}, "batch"),
    ("gp-out-rank1", "gp", {}, {}, dict(out=((2,), I32)), "out"),
]
CUDA_CASES = [
    ("ix-scores-bf16", "ix", {}, {}, dict(scores=((T, 2, 2), BF16)), "scores"),
    ("ix-scores-short", "ix", {}, {}, dict(scores=((T, 2, 1), F32)), "scores"),
]


@pytest.fixture(params=PLATFORMS)
def platform(request):
    p = request.param
    if p == "cuda" and jax.default_backend() != "gpu":
        pytest.skip("no GPU backend")
    if not _native.available(p):
        if p == "cuda":
            pytest.fail(f"CUDA library missing on a GPU machine: {_native.missing_reason('cuda')}")
        pytest.skip(f"native CPU library not available: {_native.missing_reason('cpu')}")
    return p


def _call(platform, base, operands=None, attrs=None, results=None):
    target, ops, at, res = base
    ops = {**ops, **(operands or {})}
    at = {**at, **(attrs or {})}
    res = {**res, **(results or {})}
    outs = tuple(jax.ShapeDtypeStruct(s, d) for s, d in res.values())
    fa = {k: (np.float64(v) if isinstance(v, float) else np.int64(v)) for k, v in at.items()}
    fn = jax.ffi.ffi_call(target, outs)
    dev = jax.devices("gpu" if platform == "cuda" else "cpu")[0]
    args = [jax.device_put(np.asarray(x), dev) for x in ops.values()]
    return jax.block_until_ready(jax.jit(lambda *a: fn(*a, **fa))(*args))


def test_raw_ffi_baselines_run(platform):
    for name, base in _bases(platform).items():
        got = _call(platform, base)  # must not raise
        out = np.asarray(got[0] if isinstance(got, (tuple, list)) else got)  # (a workspace's lse may hold -inf)
        if out.dtype.kind == "f" or out.dtype == BF16:
            assert np.isfinite(out.astype(np.float64)).all(), name


@pytest.mark.parametrize("case", CASES + CUDA_CASES, ids=[c[0] for c in CASES + CUDA_CASES])
def test_raw_ffi_rejects(platform, case):
    if platform != "cuda" and case in CUDA_CASES:
        pytest.skip(f"{case[0]}: a result only the CUDA handler has")
    cid, b, operands, attrs, results, name = case
    base = _bases(platform)[b]
    with pytest.raises(Exception) as info:  # noqa: PT011 - XLA's runtime error type differs between jax versions
        _call(platform, base, operands, attrs, results)
    msg = str(info.value)
    m = re.search(re.escape(base[0]) + r": ([^:]+):", msg)  # "<target>: <operand(s)>: <what>"
    assert m, f"{cid}: the error does not name the target: {msg[:300]}"
    named = set(re.split(r"\s*[/,]\s*", m.group(1)))
    assert named & set(name.split(", ")), f"{cid}: the error names {sorted(named)}, not {name!r}: {msg[:300]}"


@pytest.mark.parametrize("axis", ["heads", "head_dim"])
@pytest.mark.parametrize("op", ["ragged_paged", "padded_paged", "ragged_no_cache", "padded_no_cache", "msa", "indexer"])
def test_empty_heads_or_head_dim_rejected_at_trace_time(op, axis):
    """H = 0 (Hi = 0) or a head dim of 0 is a shape error at trace time naming q (before, the reference raised
    ZeroDivisionError from the default scale or the group, and the CPU handler divided by the group)."""
    h, d = (0, 64) if axis == "heads" else (4, 0)
    kv = np.ones((4, 2, 1, 16, 2, d), BF16)
    offs, cl, lut = np.array([0, 1, 3], np.int32), np.array([5, 7], np.int32), np.array([[0, 1], [2, 3]], np.int32)
    with pytest.raises(OpShapeError, match="'q'"):
        if op == "ragged_paged":
            msa_ops.mha_ragged_paged(np.zeros((3, h, d), BF16), offs, kv, cl, lut, 0)
        elif op == "padded_paged":
            msa_ops.mha_padded_paged(np.zeros((2, 3, h, d), BF16), kv, cl, lut, 0, np.array([1, 2], np.int32))
        elif op == "ragged_no_cache":
            msa_ops.mha_ragged_no_cache(np.zeros((3, h, d), BF16), np.ones((3, 2, d), BF16), np.ones((3, 2, d), BF16),
                                        offs)
        elif op == "padded_no_cache":
            msa_ops.mha_padded_no_cache(np.zeros((2, 3, h, d), BF16), np.ones((2, 3, 2, d), BF16),
                                        np.ones((2, 3, 2, d), BF16), np.array([1, 2], np.int32))
        elif op == "msa":
            msa_ops.msa_attention_ragged_paged(np.zeros((3, h, 128 if axis == "heads" else 0), BF16), offs, None,
                                               np.ones((4, 2, 1, 128, 2, 128), BF16), cl, lut, 0,
                                               np.zeros((2, 3, 2), np.int32))
        else:
            di = 32 if axis == "heads" else 0
            msa_ops.msa_indexer_ragged_paged(np.zeros((3, h, di), BF16), offs, np.ones((4, 1, 1, 128, 1, di), BF16),
                                             cl, lut, 0, topk=2)
