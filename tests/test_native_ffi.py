"""The CPU FFI handlers called directly through jax.ffi.ffi_call (the contract of docs/SEMANTICS.md,
"Native (XLA FFI) contract"), checked against a small float64 NumPy implementation written here,
independent of the C++ and of msa_ops' reference lowering.

Skips when libmsa_ops_cpu.so is not built (see msa_ops._native.missing_reason('cpu')).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import oracle
import pytest
from conftest import on_cpu

jax = pytest.importorskip("jax")
import jax.numpy as jnp


def _load_native():
    try:
        from msa_ops import _native

        return _native
    except Exception:  # noqa: BLE001 - fall back to the file itself when the package does not import
        path = Path(__file__).resolve().parents[1] / "msa_ops" / "_native.py"
        spec = importlib.util.spec_from_file_location("_msa_ops_native_standalone", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up in sys.modules
        spec.loader.exec_module(mod)
        return mod


_native = _load_native()
if not _native.available("cpu"):
    pytest.skip(f"native CPU library not available: {_native.missing_reason('cpu')}", allow_module_level=True)

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
TOL = {F32: 1e-5, BF16: 1e-2, F16: 1e-2, FP8: 5e-2}
MASKS = {"null": 0, "causal": 1, "sliding_window_causal": 2, "sliding_window_noncausal": 3, "chunked_causal": 4}


@pytest.fixture(autouse=True)
def _on_cpu():
    """The targets called here are registered for the CPU only: run on it where the default backend is a GPU."""
    with on_cpu():
        yield


# ------------------------------------------------------------------------------------------------ helpers
def i64(x):
    return np.int64(x)


def f64(x):
    return np.float64(x)


def i32(x):
    return np.asarray(x, dtype=np.int64).astype(np.int32)  # wraps like a uint32 -> int32 reinterpretation


def rnd(rng, shape, dtype, std=1.0):
    return (rng.standard_normal(shape) * std).astype(np.float32).astype(dtype)


def rel_err(got, ref):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    den = np.linalg.norm(ref.ravel())
    num = np.linalg.norm((got - ref).ravel())
    return 0.0 if num == 0 else (num / den if den > 0 else math.inf)


def check(got, ref, tol, what=""):
    got = np.asarray(got).astype(np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    zero_ref = np.all(ref == 0, axis=-1)
    assert np.all(got[zero_ref] == 0), f"{what}: rows that must be exactly 0 are not"
    err = rel_err(got, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"
    return err


def repaired(offsets, total):
    """eff[j] = min(T, max(0, max_{i<=j} offsets[i]))."""
    out, run = [], 0
    for o in np.asarray(offsets, np.int64):
        run = max(run, int(o))
        out.append(min(total, run))
    return out


def visible(mask, w, p, k, num_keys):
    """SPEC.md mask table, written directly (k is an existing key)."""
    if mask == 0:
        return k < num_keys
    if mask == 1:
        return k <= p
    if mask == 2:
        return k <= p and p - k < w
    if mask == 3:
        return k + w > p and k < num_keys
    if mask == 4:
        return k <= p and p // w == k // w
    raise ValueError(mask)


def softmax_row(q, keys, vals, scale, sink=None):
    """q[D] f64, keys/vals [n, D] f64 -> out[D]; 0 when there are no keys."""
    if len(keys) == 0:
        return np.zeros(q.shape[-1])
    s = scale * (keys @ q)
    m = s.max()
    if sink is not None:
        m = max(m, sink)
    e = np.exp(s - m)
    den = e.sum() + (np.exp(sink - m) if sink is not None else 0.0)
    return (e @ vals) / den


def paged_key(kv, lut, b, k, layer, nk_exist):
    """(K row [Hkv,D], V row) of key k of sequence b, or None when it does not exist."""
    nb, _, L, P = kv.shape[:4]
    mp = lut.shape[1]
    if k < 0 or k >= min(nk_exist, mp * P) or not (0 <= layer < L):
        return None
    page = int(lut[b, k // P])
    if not (0 <= page < nb):
        return None
    return kv[page, 0, layer, k % P], kv[page, 1, layer, k % P]


# ------------------------------------------------------------------------------------------------ oracles
def oracle_paged(q, rows, kv, lut, layer, mask, w, scale, sink=None):
    """rows: list of (flat_row, b, p, num_keys). q[R,H,D] (any float) -> out f64[R,H,D]."""
    q = np.asarray(q, np.float64)
    kv = np.asarray(kv, np.float64)
    R, H, D = q.shape
    hkv = kv.shape[4]
    g = H // hkv
    out = np.zeros((R, H, D))
    for row, b, p, nkeys in rows:
        ks = []
        for k in range(nkeys):
            kvr = paged_key(kv, lut, b, k, layer, nkeys)
            if kvr is not None and visible(mask, w, p, k, nkeys):
                ks.append((k, kvr))
        for h in range(H):
            kk = np.array([x[1][0][h // g] for x in ks]).reshape(-1, D)
            vv = np.array([x[1][1][h // g] for x in ks]).reshape(-1, D)
            out[row, h] = softmax_row(q[row, h], kk, vv, scale, None if sink is None else float(sink[h]))
    return out


def oracle_contig(q, rows, k, v, mask, w, scale):
    """rows: list of (flat_row, kv_row0, p, nk). k/v [*, Hkv, D] flat rows."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    R, H, D = q.shape
    g = H // k.shape[1]
    out = np.zeros((R, H, D))
    for row, r0, p, nk in rows:
        vis = [j for j in range(nk) if visible(mask, w, p, j, nk)]
        for h in range(H):
            out[row, h] = softmax_row(q[row, h], k[[r0 + j for j in vis], h // g].reshape(-1, D),
                                      v[[r0 + j for j in vis], h // g].reshape(-1, D), scale)
    return out


def ragged_rows(offsets, cache_lengths, T, s_max):
    eff = repaired(offsets, T)
    rows = []
    for b in range(len(cache_lengths)):
        n = eff[b + 1] - eff[b]
        c = min(max(int(cache_lengths[b]), 0), s_max)
        for i in range(n):
            rows.append((eff[b] + i, b, c + i, c + n))
    return rows


# ------------------------------------------------------------------------------------------------ callers
def sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def call_ragged_paged(q, offsets, kv, cl, lut, layer, sink=None, *, mask=1, window=-1, scale=None, np_=1, block_n=64):
    T, H, D = q.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    npw = np_ if np_ > 1 else 0
    outs = (sds(q.shape, q.dtype), sds((npw, T, H, D), F32), sds((npw, T, H), F32))
    has_sink = sink is not None
    if sink is None:
        sink = np.zeros((H,), q.dtype)
    fn = jax.ffi.ffi_call("msa_ops_mha_ragged_paged", outs)
    return fn(q, i32(offsets), kv, i32(cl), i32(lut), i32(layer), np.asarray(sink, q.dtype), mask=i64(mask),
              window=i64(window), scale=f64(scale), has_sink=i64(has_sink), num_partitions=i64(np_),
              block_n=i64(block_n), tile_m=i64(16))


def make_pool(rng, B, MP, P, L, hkv, D, dtype, extra=3):
    nb = B * MP + extra
    kv = rnd(rng, (nb, 2, L, P, hkv, D), dtype)
    lut = rng.permutation(nb)[: B * MP].reshape(B, MP).astype(np.int32)
    return kv, lut


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("with_sink", [False, True])
def test_ragged_paged_masks(mask, with_sink):
    rng = np.random.default_rng(MASKS[mask] * 7 + with_sink)
    B, MP, P, L, hkv, g, D = 4, 6, 16, 2, 2, 2, 32
    H = hkv * g
    kv, lut = make_pool(rng, B, MP, P, L, hkv, D, F32)
    n = [5, 1, 0, 9]
    cl = [17, 40, 3, 0]
    offsets = np.concatenate([[0], np.cumsum(n)])
    T = int(offsets[-1]) + 2  # two padding rows
    q = rnd(rng, (T, H, D), F32)
    sink = rnd(rng, (H,), F32, 2.0) if with_sink else None
    window = 7
    layer = 1
    out, _, _ = call_ragged_paged(q, offsets, kv, cl, lut, layer, sink, mask=MASKS[mask], window=window)
    ref = oracle_paged(q, ragged_rows(offsets, cl, T, MP * P), kv, lut, layer, MASKS[mask], window,
                       1 / math.sqrt(D), sink)
    check(out, ref, TOL[F32], f"{mask} sink={with_sink}")


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("mask", [0, 1, 2, 4])
def test_split_k_partitions_agree(dtype, mask):
    rng = np.random.default_rng(11 + mask)
    B, MP, P, L, hkv, g, D = 3, 12, 32, 1, 2, 4, 64
    H = hkv * g
    kv, lut = make_pool(rng, B, MP, P, L, hkv, D, dtype)
    n = [1, 1, 3]
    cl = [300, 37, 200]
    offsets = np.concatenate([[0], np.cumsum(n)])
    T = int(offsets[-1])
    q = rnd(rng, (T, H, D), dtype)
    sink = rnd(rng, (H,), dtype)
    ref = oracle_paged(q, ragged_rows(offsets, cl, T, MP * P), kv, lut, 0, mask, 50, 0.2, sink)
    outs = {}
    for np_ in (1, 2, 7):
        out, ws_o, _ = call_ragged_paged(q, offsets, kv, cl, lut, 0, sink, mask=mask, window=50, scale=0.2,
                                         np_=np_)
        assert ws_o.shape == ((np_, T, H, D) if np_ > 1 else (0, T, H, D))
        check(out, ref, TOL[dtype], f"np={np_}")
        outs[np_] = np.asarray(out, np.float64)
    if dtype == F32:
        for np_ in (2, 7):
            assert np.max(np.abs(outs[np_] - outs[1])) <= 1e-5
    else:  # one rounding step of the output dtype apart at most
        for np_ in (2, 7):
            assert rel_err(outs[np_], outs[1]) <= 1e-2


@pytest.mark.parametrize("block_n", [2**20 + 1, 2**40, 2**62, 2**63 - 1])
def test_split_k_huge_block_n_reads_as_2_20(block_n):
    """block_n past 2^20 reads as 2^20 (as on CUDA): every key of these sequences in partition 0, the others empty,
    the sink counted once. (Before, p * s overflowed int64 for block_n near 2^62 and partitions 2.. covered every
    key again, which a sink's share showed.)"""
    rng = np.random.default_rng(5)
    B, MP, P, L, hkv, g, D = 2, 4, 16, 1, 1, 2, 16
    H = hkv * g
    kv, lut = make_pool(rng, B, MP, P, L, hkv, D, F32)
    cl = [40, 63]
    offsets = np.array([0, 1, 2])
    q = rnd(rng, (2, H, D), F32)
    sink = rnd(rng, (H,), F32, 2.0)
    ref = oracle_paged(q, ragged_rows(offsets, cl, 2, MP * P), kv, lut, 0, 1, -1, 1 / math.sqrt(D), sink)
    out, _, _ = call_ragged_paged(q, offsets, kv, cl, lut, 0, sink, np_=5, block_n=block_n)
    check(out, ref, TOL[F32], f"block_n={block_n}")
    unsplit, _, _ = call_ragged_paged(q, offsets, kv, cl, lut, 0, sink, np_=1)
    assert np.max(np.abs(np.asarray(out, np.float64) - np.asarray(unsplit, np.float64))) <= 1e-6


def test_split_k_workspace_partials():
    """The workspace holds normalized partials and log2 sums of each partition (SEMANTICS.md §6)."""
    rng = np.random.default_rng(5)
    B, MP, P, L, hkv, D = 1, 4, 64, 1, 1, 16
    kv, lut = make_pool(rng, B, MP, P, L, hkv, D, F32)
    q = rnd(rng, (1, 1, D), F32)
    cl = [200]  # N = 201 keys; np=2 -> s = 128: [0,128), [128,201)
    _, ws_o, ws_lse = call_ragged_paged(q, [0, 1], kv, cl, lut, 0, mask=0, scale=0.3, np_=2)
    kk = np.array([kv[lut[0, k // P], 0, 0, k % P, 0] for k in range(201)], np.float64)
    vv = np.array([kv[lut[0, k // P], 1, 0, k % P, 0] for k in range(201)], np.float64)
    s = 0.3 * kk @ q[0, 0].astype(np.float64)
    for p, (lo, hi) in enumerate([(0, 128), (128, 201)]):
        e = np.exp(s[lo:hi])
        np.testing.assert_allclose(ws_lse[p, 0, 0], np.log2(e.sum()), rtol=1e-5)
        np.testing.assert_allclose(ws_o[p, 0, 0], (e @ vv[lo:hi]) / e.sum(), rtol=1e-4, atol=1e-6)
    # 7 partitions of 201 keys: s = 64 -> partitions 4..6 are empty (-inf, zeros).
    _, ws_o, ws_lse = call_ragged_paged(q, [0, 1], kv, cl, lut, 0, mask=0, scale=0.3, np_=7)
    assert np.all(np.isneginf(np.asarray(ws_lse)[4:, 0, 0]))
    assert np.all(np.asarray(ws_o)[4:] == 0)


def test_bad_values_never_crash():
    """Bad page ids, non-monotone / out-of-range offsets, negative and huge cache lengths, uint32 values."""
    rng = np.random.default_rng(3)
    B, MP, P, L, hkv, g, D = 5, 4, 16, 2, 1, 2, 16
    H = hkv * g
    kv, lut = make_pool(rng, B, MP, P, L, hkv, D, F32, extra=0)
    nb = kv.shape[0]
    lut[0, 1] = -1
    lut[1, 0] = nb
    lut[2, 2] = 2**31 - 1
    lut[3, :] = -5
    offsets = [0, 3, 2, 6, 40, 7]  # non-monotone, past T
    T = 8
    cl = [20, -4, 2**31 - 1, 10, int(np.uint32(0xFFFFFFF0).view(np.int32))]
    q = rnd(rng, (T, H, D), F32)
    for mask in range(5):
        for np_ in (1, 3):
            out, _, _ = call_ragged_paged(q, offsets, kv, cl, lut, 1, mask=mask, window=5, np_=np_)
            ref = oracle_paged(q, ragged_rows(offsets, cl, T, MP * P), kv, lut, 1, mask, 5, 1 / math.sqrt(D))
            check(out, ref, TOL[F32], f"bad values mask={mask} np={np_}")
    # out-of-range layer: no key exists -> all zeros (never NaN), with and without a sink
    for layer in (-1, L, 2**31 - 1):
        out, _, _ = call_ragged_paged(q, offsets, kv, cl, lut, layer, np.ones(H, F32), np_=2)
        assert np.all(np.asarray(out) == 0)
    # every offset negative: everything is padding
    out, _, _ = call_ragged_paged(q, [-3] * (B + 1), kv, cl, lut, 0)
    assert np.all(np.asarray(out) == 0)


def test_padded_paged():
    rng = np.random.default_rng(4)
    B, S, MP, P, L, hkv, g, D = 4, 5, 5, 16, 1, 2, 2, 32
    H = hkv * g
    kv, lut = make_pool(rng, B, MP, P, L, hkv, D, BF16)
    q = rnd(rng, (B, S, H, D), BF16)
    cl = [10, 0, 70, 33]
    vl = [3, 0, 9, -2]
    for np_ in (1, 3):
        npw = np_ if np_ > 1 else 0
        outs = (sds(q.shape, BF16), sds((npw, B * S, H, D), F32), sds((npw, B * S, H), F32))
        out, _, _ = jax.ffi.ffi_call("msa_ops_mha_padded_paged", outs)(
            q, kv, i32(cl), i32(lut), i32(0), i32(vl), mask=i64(1), window=i64(-1), scale=f64(0.125),
            num_partitions=i64(np_), block_n=i64(64), tile_m=i64(64))
        rows = []
        for b in range(B):
            nq = min(max(vl[b], 0), S)
            c = min(max(cl[b], 0), MP * P)
            rows += [(b * S + i, b, c + i, c + nq) for i in range(nq)]
        ref = oracle_paged(q.reshape(B * S, H, D), rows, kv, lut, 0, 1, -1, 0.125)
        check(np.asarray(out).reshape(B * S, H, D), ref, TOL[BF16], f"padded paged np={np_}")


@pytest.mark.parametrize("mask", list(MASKS))
def test_ragged_no_cache(mask):
    rng = np.random.default_rng(20 + MASKS[mask])
    hkv, g, D = 2, 3, 16
    H = hkv * g
    nq = [4, 0, 7, 2]
    nk = [6, 3, 7, 1]  # last sequence: p = nk - n + i < 0 for i = 0
    qo = np.concatenate([[0], np.cumsum(nq)])
    ko = np.concatenate([[0], np.cumsum(nk)])
    T, Tk = int(qo[-1]) + 1, int(ko[-1]) + 2
    q = rnd(rng, (T, H, D), F16)
    k = rnd(rng, (Tk, hkv, D), F16)
    v = rnd(rng, (Tk, hkv, D), F16)
    out = jax.ffi.ffi_call("msa_ops_mha_ragged_no_cache", sds(q.shape, F16))(
        q, k, v, i32(qo), i32(ko), mask=i64(MASKS[mask]), window=i64(3), scale=f64(0.3))
    rows = []
    for b in range(4):
        rows += [(int(qo[b]) + i, int(ko[b]), nk[b] - nq[b] + i, nk[b]) for i in range(nq[b])]
    check(out, oracle_contig(q, rows, k, v, MASKS[mask], 3, 0.3), TOL[F16], mask)
    # non-monotone / out-of-range kv offsets
    bad_ko = [0, 9, 4, 100, -1]
    out = jax.ffi.ffi_call("msa_ops_mha_ragged_no_cache", sds(q.shape, F16))(
        q, k, v, i32(qo), i32(bad_ko), mask=i64(MASKS[mask]), window=i64(3), scale=f64(0.3))
    ek = repaired(bad_ko, Tk)
    rows = []
    for b in range(4):
        n_k = ek[b + 1] - ek[b]
        rows += [(int(qo[b]) + i, ek[b], n_k - nq[b] + i, n_k) for i in range(nq[b])]
    check(out, oracle_contig(q, rows, k, v, MASKS[mask], 3, 0.3), TOL[F16], mask + " bad kv offsets")


def test_padded_no_cache():
    rng = np.random.default_rng(30)
    B, S, Sk, hkv, g, D = 3, 4, 6, 1, 4, 16
    H = hkv * g
    q = rnd(rng, (B, S, H, D), F32)
    k = rnd(rng, (B, Sk, hkv, D), F32)
    v = rnd(rng, (B, Sk, hkv, D), F32)
    vl = [3, 9, -1]
    for mask in range(5):
        out = jax.ffi.ffi_call("msa_ops_mha_padded_no_cache", sds(q.shape, F32))(
            q, k, v, i32(vl), mask=i64(mask), window=i64(2), scale=f64(0.25))
        rows = []
        for b in range(B):
            n_q, n_k = min(max(vl[b], 0), S), min(max(vl[b], 0), Sk)
            rows += [(b * S + i, b * Sk, n_k - n_q + i, n_k) for i in range(n_q)]
        ref = oracle_contig(q.reshape(B * S, H, D), rows, k.reshape(B * Sk, hkv, D), v.reshape(B * Sk, hkv, D),
                            mask, 2, 0.25)
        check(np.asarray(out).reshape(B * S, H, D), ref, TOL[F32], f"padded no cache mask={mask}")


# ------------------------------------------------------------------------------------------------ MSA
def oracle_msa(q, offsets, cl, kv, lut, layer, d_idx, scale):
    q = np.asarray(q, np.float64)
    kvf = np.asarray(kv, np.float64)
    T, H, D = q.shape
    hkv = kvf.shape[4]
    g = H // hkv
    MP = lut.shape[1]
    out = np.zeros((T, H, D))
    for row, b, p, nkeys in ragged_rows(offsets, cl, T, MP * 128):
        for gi in range(hkv):
            ids = {int(j) for j in d_idx[gi, row] if 0 <= j < MP and 128 * j < nkeys}
            keys = []
            for j in sorted(ids):
                for k in range(128 * j, 128 * j + 128):
                    kvr = paged_key(kvf, lut, b, k, layer, nkeys)
                    if kvr is not None and k <= p:
                        keys.append(kvr)
            kk = np.array([x[0][gi] for x in keys]).reshape(-1, D)
            vv = np.array([x[1][gi] for x in keys]).reshape(-1, D)
            for hh in range(g):
                out[row, gi * g + hh] = softmax_row(q[row, gi * g + hh], kk, vv, scale)
    return out


def call_msa(q, offsets, cl, kv, lut, layer, d_idx, scale, np_):
    T, H, D = q.shape
    npw = np_ if np_ > 1 else 0
    cro = np.concatenate([[0], np.cumsum(np.maximum(cl, 0) + np.diff(offsets))])
    outs = (sds((T, H, D), BF16), sds((npw, T, H, D), F32), sds((npw, T, H), F32))
    return jax.ffi.ffi_call("msa_ops_msa_attention", outs)(
        q, i32(offsets), i32(cro), kv, i32(cl), i32(lut), i32(layer), i32(d_idx), scale=f64(scale),
        num_partitions=i64(np_), max_q=i64(int(np.diff(offsets).max(initial=0))))[0]


@pytest.mark.parametrize("dtype", [BF16, FP8])
@pytest.mark.parametrize("route", ["decode", "spec", "prefill"])
def test_msa_attention(dtype, route):
    rng = np.random.default_rng(40 + (route == "spec") + 2 * (route == "prefill") + 5 * (dtype == FP8))
    B, MP, L, hkv, g, D, topk = 3, 5, 2, 2, 2, 128, 4
    H = hkv * g
    kv, lut = make_pool(rng, B, MP, 128, L, hkv, D, dtype, extra=1)
    lut[2, 3] = -1  # a selected page that does not exist
    n = {"decode": [1, 1, 1], "spec": [3, 0, 5], "prefill": [20, 140, 9]}[route]
    cl = [400, 130, 260] if route != "prefill" else [0, 200, 17]
    offsets = np.concatenate([[0], np.cumsum(n)])
    T = int(offsets[-1]) + 1
    q = rnd(rng, (T, H, D), dtype)
    d_idx = rng.integers(-1, MP + 1, (hkv, T, topk)).astype(np.int32)
    d_idx[0, 0, :2] = 2  # duplicate
    d_idx[1, 0, :] = [3, 3, 3, -1]
    scale = 1 / math.sqrt(D)
    ref = oracle_msa(q, offsets, cl, kv, lut, 1, d_idx, scale)
    outs = {}
    for np_ in (1, 2, 3):
        out = call_msa(q, offsets, cl, kv, lut, 1, d_idx, scale, np_)
        assert out.dtype == BF16
        check(out, ref, TOL[dtype], f"msa {route} np={np_}")
        outs[np_] = np.asarray(out, np.float64)
    assert rel_err(outs[3], outs[1]) <= 1e-2 and rel_err(outs[2], outs[1]) <= 1e-2
    # out-of-range layer -> zeros
    assert np.all(np.asarray(call_msa(q, offsets, cl, kv, lut, L, d_idx, scale, 2)) == 0)


# ------------------------------------------------------------------------------------------------ indexer
def oracle_indexer(q, offsets, kb, cl, lut, layer, topk, init, local, scale):
    q = np.asarray(q, np.float64)
    kb = np.asarray(kb, np.float64)
    T, Hi, _ = q.shape
    NB, _, L = kb.shape[:3]
    MP = lut.shape[1]
    out = np.full((Hi, T, topk), -1, np.int32)
    for row, b, p, nkeys in ragged_rows(offsets, cl, T, MP * 128):
        elig, scores = [], []
        for j in range(MP):
            ks = []
            for k in range(128 * j, min(128 * j + 128, nkeys, MP * 128, p + 1)):
                page = int(lut[b, j])
                if 0 <= page < NB and 0 <= layer < L:
                    ks.append(kb[page, 0, layer, k % 128, 0])
            if ks:
                elig.append(j)
                scores.append(scale * (np.array(ks) @ q[row].T).max(axis=0))  # [Hi]
        for h in range(Hi):
            if len(elig) <= topk:
                chosen = list(elig)
            else:
                forced = elig[:init] + elig[len(elig) - local:]
                rest = [(-scores[i][h], elig[i]) for i in range(init, len(elig) - local)]
                rest.sort()
                chosen = forced + [j for _, j in rest[: topk - init - local]]
            chosen = sorted(chosen)
            out[h, row, : len(chosen)] = chosen
    return out


@pytest.mark.parametrize("dtype", [F32, BF16, FP8])
def test_indexer(dtype):
    rng = np.random.default_rng(50)
    B, MP, L, Hi, Di = 3, 8, 2, 3, 32
    NB = B * MP + 1
    kb = rnd(rng, (NB, 1, L, 128, 1, Di), dtype)
    lut = rng.permutation(NB)[: B * MP].reshape(B, MP).astype(np.int32)
    lut[0, 2] = -1
    lut[1, 4] = NB + 5
    n = [3, 1, 140]
    cl = [900, 700, 10]
    offsets = np.concatenate([[0], np.cumsum(n)])
    T = int(offsets[-1]) + 2
    q = rnd(rng, (T, Hi, Di), dtype)
    for topk, init, local in [(4, 1, 1), (3, 0, 0), (10, 2, 3), (2, 0, 2)]:
        out = jax.ffi.ffi_call("msa_ops_msa_indexer", sds((Hi, T, topk), np.int32))(
            q, i32(offsets), kb, i32(cl), i32(lut), i32(1), topk=i64(topk), init_blocks=i64(init),
            local_blocks=i64(local), scale=f64(0.2))
        ref = oracle_indexer(q, offsets, kb, cl, lut, 1, topk, init, local, 0.2)
        np.testing.assert_array_equal(np.asarray(out), ref, err_msg=f"topk={topk} init={init} local={local}")
    # ties (all-zero queries): lowest ids win
    qz = np.zeros_like(q)
    out = jax.ffi.ffi_call("msa_ops_msa_indexer", sds((Hi, T, 3), np.int32))(
        qz, i32(offsets), kb, i32(cl), i32(lut), i32(1), topk=i64(3), init_blocks=i64(0), local_blocks=i64(1),
        scale=f64(0.2))
    np.testing.assert_array_equal(np.asarray(out), oracle_indexer(qz, offsets, kb, cl, lut, 1, 3, 0, 1, 0.2))
    # out-of-range layer -> all -1
    out = jax.ffi.ffi_call("msa_ops_msa_indexer", sds((Hi, T, 3), np.int32))(
        q, i32(offsets), kb, i32(cl), i32(lut), i32(-1), topk=i64(3), init_blocks=i64(0), local_blocks=i64(1),
        scale=f64(0.2))
    assert np.all(np.asarray(out) == -1)


# ------------------------------------------------------------------------------------------------ KV store etc.
def oracle_store(kv, k, v, offsets, cl, lut, layer):
    kv = np.array(kv)
    NB, _, L, P = kv.shape[:4]
    MP = lut.shape[1]
    eff = repaired(offsets, k.shape[0])
    for b in range(len(cl)):
        for t in range(eff[b], eff[b + 1]):
            pos = max(0, int(cl[b])) + t - eff[b]
            if pos >= MP * P or not (0 <= layer < L):
                continue
            page = int(lut[b, pos // P])
            if 0 <= page < NB:
                kv[page, 0, layer, pos % P] = k[t]
                kv[page, 1, layer, pos % P] = v[t]
    return kv


@pytest.mark.parametrize("dtype", [BF16, F32, FP8])
@pytest.mark.parametrize("aliased", [True, False])
def test_kv_cache_store(dtype, aliased):
    rng = np.random.default_rng(60)
    B, MP, P, L, hkv, D = 3, 3, 8, 2, 2, 8
    kv, lut = make_pool(rng, B, MP, P, L, hkv, D, dtype, extra=2)
    lut[1, 1] = -1
    lut[2, 2] = 99
    n = [5, 9, 4]
    cl = [2, 7, 21]  # sequence 2 runs past the page table (rows dropped)
    offsets = np.concatenate([[0], np.cumsum(n)])
    T = int(offsets[-1]) + 1
    k = rnd(rng, (T, hkv, D), dtype)
    v = rnd(rng, (T, hkv, D), dtype)
    for layer in (1, 5):
        ref = oracle_store(kv, k, v, offsets, cl, lut, layer)
        fn = jax.ffi.ffi_call("msa_ops_kv_cache_store", sds(kv.shape, dtype),
                              input_output_aliases={0: 0} if aliased else None)
        def store(kv_, k_, v_, fn=fn, layer=layer):
            return fn(kv_, k_, v_, i32(offsets), i32(cl), i32(lut), i32(layer))

        f = jax.jit(store, donate_argnums=(0,) if aliased else ())
        kv_dev = jnp.array(kv)
        out = f(kv_dev, k, v)
        np.testing.assert_array_equal(np.asarray(out).view(np.uint8), ref.view(np.uint8))


def test_kv_cache_row_offsets():
    offsets = [0, 3, 4, 4, 10]
    cl = [5, -2, 0, 2**31 - 100]
    out = jax.ffi.ffi_call("msa_ops_kv_cache_row_offsets", sds((5,), np.int32))(i32(offsets), i32(cl))
    exp = np.array([0, 8, 9, 9, (9 + 2**31 - 100 + 6) - 2**32], np.int64).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(out), exp)
    # non-monotone offsets are repaired (running max)
    out = jax.ffi.ffi_call("msa_ops_kv_cache_row_offsets", sds((4,), np.int32))(i32([2, 5, 1, 7]), i32([1, 1, 1]))
    np.testing.assert_array_equal(np.asarray(out), [0, 4, 5, 8])


def test_get_num_partitions():
    fn = jax.ffi.ffi_call("msa_ops_get_num_partitions", sds((), np.int32))
    for batch, length, n_kv, sm in [(1, 4096, 8, 132), (8, 4096, 8, 132), (1, 100, 8, 132), (2, 100000, 1, 148),
                                    (0, 2048, 8, 132), (3, -5, 8, 132), (2 ** 31 - 1, 4096, 2 ** 40, 132),
                                    (5, 10 ** 6, 2 ** 40, 2 ** 50), (7, 10 ** 6, 0, 132)]:
        got = int(fn(i32(batch), i32(length), n_kv_heads=i64(n_kv), sm_count=i64(sm)))
        assert got == oracle.get_num_partitions(batch, length, n_kv_heads=n_kv, sm_count=sm), (batch, length, n_kv, sm)


def test_bad_attribute_is_an_error():
    rng = np.random.default_rng(0)
    kv, lut = make_pool(rng, 1, 1, 8, 1, 1, 8, F32)
    q = rnd(rng, (1, 1, 8), F32)
    with pytest.raises(Exception, match="mask"):
        np.asarray(call_ragged_paged(q, [0, 1], kv, [0], lut, 0, mask=9)[0])
    with pytest.raises(Exception, match="window"):
        np.asarray(call_ragged_paged(q, [0, 1], kv, [0], lut, 0, mask=2, window=0)[0])


def test_info():
    inf = _native.info()
    cpu = inf["platforms"]["cpu"]
    assert cpu["available"] and sorted(cpu["registered_targets"]) == sorted(_native.TARGETS)
    assert cpu["version"] and cpu["archs"]
    assert _native.missing_reason("cpu") == ""
    assert isinstance(_native.available("cuda"), bool)
