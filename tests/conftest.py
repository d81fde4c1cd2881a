"""Shared fixtures and helpers of the msa_ops test-suite (random ragged batches, paged caches, tolerances).

Everything here is NumPy-only so the oracle self-checks run without msa_ops; the `impl` fixture imports
msa_ops lazily.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import ml_dtypes
import numpy as np
import pytest

# ----------------------------------------------------------------------------------------------------------
# dtypes and tolerances
# ----------------------------------------------------------------------------------------------------------
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
DTYPES = {"f32": np.dtype(np.float32), "bf16": BF16, "f16": np.dtype(np.float16), "fp8": FP8}

# Relative Frobenius error budgets against the f64 oracle run on the SAME (already quantized) inputs.
BUDGETS = {"f32": 1e-5, "bf16": 1e-2, "f16": 1e-2, "fp8": 5e-2}


def dtype_name(dt) -> str:
    dt = np.dtype(dt)
    for name, d in DTYPES.items():
        if d == dt:
            return name
    raise KeyError(dt)


def budget_for(*dtypes) -> float:
    """Budget of the least precise of the given dtypes (e.g. q dtype and kv dtype)."""
    return max(BUDGETS[dtype_name(d)] for d in dtypes)


def rel_frobenius(got, ref) -> float:
    got = np.asarray(got).astype(np.float64)
    ref = np.asarray(ref).astype(np.float64)
    num = np.linalg.norm((got - ref).ravel())
    den = np.linalg.norm(ref.ravel())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return float(num / den)


def assert_close(got, ref, budget: float, *, zero_rows_axes: int = 1, what: str = ""):
    """Compare an op output with the f64 oracle.

    * no NaN / inf anywhere in `got`;
    * wherever the oracle is exactly zero on a whole trailing vector (one head of one row: the last
      `zero_rows_axes` axes), the op must be exactly zero too (padding rows, fully masked rows);
    * relative Frobenius error <= budget.
    """
    got = np.asarray(got)
    ref = np.asarray(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != oracle {ref.shape}"
    g = got.astype(np.float64)
    assert np.isfinite(g).all(), f"{what}: non-finite values at {np.argwhere(~np.isfinite(g))[:8].tolist()}"
    axes = tuple(range(ref.ndim - zero_rows_axes, ref.ndim))
    ref_zero = np.all(ref == 0, axis=axes)
    got_zero = np.all(g == 0, axis=axes)
    bad = ref_zero & ~got_zero
    assert not bad.any(), (f"{what}: {int(bad.sum())} vectors must be exactly 0 (padding / fully masked) but "
                           f"are not, e.g. at {np.argwhere(bad)[:8].tolist()}")
    err = rel_frobenius(g, ref)
    assert err <= budget, f"{what}: relative Frobenius error {err:.3e} > budget {budget:.1e}"
    return err


# ----------------------------------------------------------------------------------------------------------
# random data
# ----------------------------------------------------------------------------------------------------------
def rand(rng: np.random.Generator, shape, dtype, std: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(np.float32).astype(dtype)


def to_uint32(x) -> np.ndarray:
    """Same bit pattern as uint32 (so -1 becomes 0xFFFFFFFF)."""
    return np.asarray(x, np.int32).view(np.uint32)


@dataclasses.dataclass
class RaggedBatch:
    n: list  # query rows per sequence
    cache: list  # cache length per sequence (before this step)
    T: int  # query rows in total, including padding rows past offsets[B]

    @property
    def B(self):
        return len(self.n)

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.n)]).astype(np.int32)

    @property
    def cache_lengths(self) -> np.ndarray:
        return np.asarray(self.cache, np.int32)


# Fixed shapes per scenario, so that jit compilations are shared across seeds.
SCENARIOS = ("prefill", "decode", "decode1", "spec", "mixed", "long")


def make_batch(rng: np.random.Generator, scenario: str, s_max: int = 512) -> RaggedBatch:
    """Random ragged batch of a scenario with c_b + n_b <= s_max for every sequence.

    prefill : 3 sequences, 0..30 new rows each (empty sequences likely), no cache, padding rows.
    decode  : 5 sequences, n_b = 1, random caches (one of them empty cache), 1 padding row.
    decode1 : 1 sequence, n_b = 1 (T = 1).
    spec    : 3 sequences, n_b in 2..8 (speculative decode), random caches, padding rows.
    mixed   : 4 sequences: one empty, one decode, one 2..8, one 20..60 chunk, all with caches; shuffled.
    long    : 2 sequences: a 180..250-row prompt with a 50..200-token cache and a short one; padding rows.
    """
    if scenario == "prefill":
        n = [int(x) for x in rng.integers(0, 31, 3)]
        if sum(n) == 0:
            n[1] = 7
        if 0 not in n:
            n[int(rng.integers(3))] = 0
        return RaggedBatch(n, [0, 0, 0], 96)
    if scenario == "decode":
        cache = [int(x) for x in rng.integers(0, s_max, 5)]
        cache[int(rng.integers(5))] = 0
        return RaggedBatch([1] * 5, cache, 6)
    if scenario == "decode1":
        return RaggedBatch([1], [int(rng.integers(0, s_max))], 1)
    if scenario == "spec":
        n = [int(x) for x in rng.integers(2, 9, 3)]
        cache = [int(rng.integers(0, s_max - m + 1)) for m in n]
        return RaggedBatch(n, cache, 28)
    if scenario == "mixed":
        n = [0, 1, int(rng.integers(2, 9)), int(rng.integers(20, 61))]
        cache = [int(rng.integers(0, s_max - m + 1)) for m in n]
        perm = rng.permutation(4)
        return RaggedBatch([n[i] for i in perm], [cache[i] for i in perm], 80)
    if scenario == "long":
        n = [int(rng.integers(180, 251)), int(rng.integers(1, 41))]
        cache = [int(rng.integers(50, 201)), int(rng.integers(0, 201))]
        return RaggedBatch(n, cache, 300)
    raise ValueError(scenario)


@dataclasses.dataclass
class PagedCache:
    kv_blocks: np.ndarray  # [NB, kv, L, P, Hkv, D]
    lut: np.ndarray  # [B, MP] int32
    page_size: int

    @property
    def s_max(self):
        return self.lut.shape[1] * self.page_size


def make_paged_cache(rng: np.random.Generator, seq_tokens, *, page_size: int, max_pages: int, n_kv_heads: int,
                     head_dim: int, num_layers: int = 2, dtype=np.float32, kv: int = 2, extra_pages: int = 3,
                     junk_tail: bool = True, std: float = 1.0) -> PagedCache:
    """A pool of NB = B * max_pages + extra_pages random pages (every page, every layer random data) and a page
    table that scatters each sequence's first ceil(tokens/P) pages over distinct, shuffled pages of the pool.

    Page-table entries past a sequence's tokens are junk (-1, ids past the pool, or pages of other sequences)
    when junk_tail, which a correct op never reads as keys.
    """
    B = len(seq_tokens)
    nb = B * max_pages + extra_pages
    kv_blocks = rand(rng, (nb, kv, num_layers, page_size, n_kv_heads, head_dim), dtype, std)
    perm = rng.permutation(nb)
    lut = np.zeros((B, max_pages), np.int32)
    used = 0
    for b, tok in enumerate(seq_tokens):
        need = -(-int(tok) // page_size)
        assert need <= max_pages, (tok, page_size, max_pages)
        lut[b, :need] = perm[used: used + need]
        used += need
        if junk_tail:
            junk = rng.choice(np.array([-1, nb, nb + 1000, -7, int(perm[0]), int(perm[-1])]),
                              max_pages - need)
            lut[b, need:] = junk
        else:
            lut[b, need:] = perm[used: used + max_pages - need]
            used += max_pages - need
    return PagedCache(kv_blocks, lut, page_size)


def share_pages(lut: np.ndarray, seq_tokens, page_size: int) -> np.ndarray:
    """A copy of the page table in which physical pages are named twice: within a sequence (its last page is
    its first page again) and across sequences (each sequence's first page is the last page of the sequence
    before it, in the original table). The same slots are then different keys of each place that names them,
    at their own positions, so no implementation may deduplicate or cache by physical page."""
    out = np.array(lut)
    pages = [-(-int(t) // page_size) for t in seq_tokens]
    within = across = 0
    for b, n in enumerate(pages):
        if n >= 2:
            out[b, n - 1] = lut[b, 0]
            within += 1
        if b and n and pages[b - 1]:
            out[b, 0] = lut[b - 1, pages[b - 1] - 1]
            across += 1
    assert within and across, f"no page shared within ({within}) or across ({across}) sequences: {pages}"
    return out


# ----------------------------------------------------------------------------------------------------------
# msa_ops access
# ----------------------------------------------------------------------------------------------------------
IMPLEMENTATIONS = ("reference", "native")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python process: JAX on the CPU, the package root of the msa_ops this process
    imported first on PYTHONPATH (so that the child imports the same one, not a source tree that happens to be its
    working directory), and `extra`."""
    import os
    from pathlib import Path

    import msa_ops

    env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
    root = str(Path(msa_ops.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def on_cpu():
    """A context that makes the CPU the default device: for calls meant for the CPU handlers, which a GPU default
    backend would otherwise send to CUDA."""
    import jax

    return jax.default_device(jax.devices("cpu")[0])


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request):
    """`implementation=` value; native skips cleanly when the CPU library is not built."""
    msa_ops = pytest.importorskip("msa_ops")
    if request.param == "native":
        try:
            from msa_ops import _native
        except Exception as e:  # noqa: BLE001  # pragma: no cover - depends on the build
            pytest.skip(f"msa_ops._native not importable: {e!r}")
        if not _native.available("cpu"):
            why = getattr(_native, "missing_reason", lambda p: "")("cpu")
            pytest.skip(f"native CPU library not available (msa_ops._native.available('cpu') is False): {why}")
        # "native" here is the CPU handler: pin the CPU device so that it is exercised on a GPU machine too
        # (where the default backend is the GPU). CUDA handlers are tested in test_gpu.py.
        with on_cpu():
            yield request.param
        return
    del msa_ops
    yield request.param


def _freeze(v):
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


@functools.cache
def _jitted(fn, frozen_kwargs):
    import jax

    return jax.jit(functools.partial(fn, **dict(frozen_kwargs)))


def jit_call(fn, *args, **static_kwargs):
    """Call `fn(*args, **static_kwargs)` under jax.jit with the kwargs static; compilations are cached by
    (fn, kwargs) so that seeds with equal shapes share one compile."""
    return _jitted(fn, _freeze(static_kwargs))(*args)
