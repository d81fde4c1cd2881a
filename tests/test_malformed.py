"""A catalogue of malformed calls: every one must be rejected at trace time (``jax.eval_shape``).

SPEC.md ("Bad input"): a wrong rank, shape, dtype or attribute is rejected at trace time with an error that
names the op, the operand, what was expected and what came. Every case below

* raises an exception that is an ``msa_ops.MsaOpsError`` and a ``ValueError`` or ``TypeError``;
* whose message names the op at fault (its MAX name) and the operand / attribute at fault;
* and differs from a good call (its "twin", checked to succeed in ``test_good_twin``) by exactly the fault.

Each case is a baseline call of one op (``BASELINES``), optionally adjusted by ``context`` (applied to the bad
call and its twin alike, e.g. a sliding-window mask with a valid window), plus the fault (operand and/or
attribute replacements). Calls go through the Python wrappers (``via="wrapper"``) or ``msa_ops.call``
(``via="call"``). Only ``ShapeDtypeStruct`` inputs are used: nothing is computed.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import msa_ops

S = jax.ShapeDtypeStruct
BF16, F16, F32, I32, U32 = jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32, jnp.uint32
FP8 = jnp.float8_e4m3fn

DROP = object()  # remove this operand / attribute from the call


# ---------------------------------------------------------------------------------------------------------
# Baselines: one good call per op (operands in MAX order, keyed by the op's operand names).
# ---------------------------------------------------------------------------------------------------------
T, B, H, HKV, D = 6, 2, 8, 2, 64  # dense MHA
NB, L, P, MP = 8, 2, 16, 4  # paged cache
MD, MP_, MNB, TOPK = 128, 3, 6, 4  # MSA: head_dim 128, page 128
HI, DI = 2, 32  # indexer heads / head dim
SB, SS, SK = 2, 5, 7  # padded: batch, query len, key len


_RP_OPERANDS = {
    "q": S((T, H, D), BF16),
    "input_row_offsets": S((B + 1,), I32),
    "kv_blocks": S((NB, 2, L, P, HKV, D), BF16),
    "cache_lengths": S((B,), I32),
    "kv_lookup_table": S((B, MP), I32),
    "layer_idx": S((), I32),
}

BASELINES: dict[str, dict[str, Any]] = {
    "mo.mha.ragged.paged": {
        "operands": dict(_RP_OPERANDS),
        "attrs": {"mask_str": "causal"},
        "out": ((T, H, D), BF16),
    },
    "mo.mha.ragged.paged.sink_weights": {
        "operands": dict(_RP_OPERANDS, sink_weights=S((H,), BF16)),
        "attrs": {"mask_str": "causal"},
        "out": ((T, H, D), BF16),
    },
    "mo.mha.padded.paged": {
        "operands": {
            "q": S((B, SS, H, D), F16),
            "kv_blocks": S((NB, 2, L, P, HKV, D), F16),
            "cache_lengths": S((B,), I32),
            "kv_lookup_table": S((B, MP), U32),
            "layer_idx": S((), I32),
            "valid_lengths": S((B,), I32),
        },
        "attrs": {"mask_str": "causal"},
        "out": ((B, SS, H, D), F16),
    },
    "mo.mha.ragged.no_cache": {
        "operands": {
            "q": S((T, H, D), F32),
            "k": S((T + 3, HKV, D), F32),
            "v": S((T + 3, HKV, D), F32),
            "input_row_offsets": S((B + 1,), I32),
            "kv_input_row_offsets": S((B + 1,), I32),
        },
        "attrs": {"mask_str": "causal"},
        "out": ((T, H, D), F32),
    },
    "mo.mha.padded.no_cache": {
        "operands": {
            "q": S((SB, SS, H, D), BF16),
            "k": S((SB, SK, HKV, D), BF16),
            "v": S((SB, SK, HKV, D), BF16),
            "valid_length": S((SB,), I32),
        },
        "attrs": {"mask_str": "causal"},
        "out": ((SB, SS, H, D), BF16),
    },
    "mo.mha.decode.get_num_partitions": {
        "operands": {"batch": S((), I32), "max_cache_valid_length": S((), I32)},
        "attrs": {"n_kv_heads": HKV, "sm_count": 132},
        "out": ((), I32),
    },
    "mo.msa.attention.ragged.paged": {
        "operands": {
            "q": S((T, H, MD), BF16),
            "input_row_offsets": S((B + 1,), I32),
            "cache_row_offsets": S((B + 1,), I32),
            "kv_blocks": S((MNB, 2, L, 128, HKV, MD), BF16),
            "cache_lengths": S((B,), I32),
            "kv_lookup_table": S((B, MP_), I32),
            "layer_idx": S((), I32),
            "d_indices": S((HKV, T, TOPK), I32),
        },
        "attrs": {},
        "out": ((T, H, MD), BF16),
    },
    "mo.msa.indexer.ragged.paged": {
        "operands": {
            "q": S((T, HI, DI), BF16),
            "input_row_offsets": S((B + 1,), I32),
            "k_blocks": S((MNB, 1, L, 128, 1, DI), BF16),
            "k_cache_lengths": S((B,), I32),
            "k_lookup_table": S((B, MP_), I32),
            "layer_idx": S((), I32),
        },
        "attrs": {"topk": TOPK, "init_blocks": 1, "local_blocks": 1},
        "out": ((HI, T, TOPK), I32),
    },
    "mo.kv_cache.store.ragged.paged": {
        "operands": {
            "kv_blocks": S((NB, 2, L, P, HKV, D), BF16),
            "k": S((T, HKV, D), BF16),
            "v": S((T, HKV, D), BF16),
            "input_row_offsets": S((B + 1,), I32),
            "cache_lengths": S((B,), I32),
            "kv_lookup_table": S((B, MP), I32),
            "layer_idx": S((), I32),
        },
        "attrs": {},
        "out": ((NB, 2, L, P, HKV, D), BF16),
    },
    "mo.kv_cache.row_offsets.ragged.paged": {
        "operands": {"input_row_offsets": S((B + 1,), I32), "cache_lengths": S((B,), U32)},
        "attrs": {},
        "out": ((B + 1,), I32),
    },
}

WRAPPERS: dict[str, Callable[..., Any]] = {
    "mo.mha.ragged.paged": msa_ops.mha_ragged_paged,
    "mo.mha.ragged.paged.sink_weights": msa_ops.mha_ragged_paged,  # sink_weights= picks the sink op
    "mo.mha.padded.paged": msa_ops.mha_padded_paged,
    "mo.mha.ragged.no_cache": msa_ops.mha_ragged_no_cache,
    "mo.mha.padded.no_cache": msa_ops.mha_padded_no_cache,
    "mo.mha.decode.get_num_partitions": msa_ops.mha_decode_get_num_partitions,
    "mo.msa.attention.ragged.paged": msa_ops.msa_attention_ragged_paged,
    "mo.msa.indexer.ragged.paged": msa_ops.msa_indexer_ragged_paged,
    "mo.kv_cache.store.ragged.paged": msa_ops.kv_cache_store_ragged_paged,
    "mo.kv_cache.row_offsets.ragged.paged": msa_ops.kv_cache_row_offsets_ragged_paged,
}


# ---------------------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    op: str  # MAX name of the op at fault (must appear in the message)
    via: str  # "wrapper" or "call"
    names: tuple[str, ...]  # further substrings the message must contain
    operands: dict = dataclasses.field(default_factory=dict)  # the fault: operand replacements / DROP
    attrs: dict = dataclasses.field(default_factory=dict)  # the fault: attribute replacements / DROP
    context: dict = dataclasses.field(default_factory=dict)  # attrs shared by the bad call and its twin
    call_name: str | None = None  # name passed to msa_ops.call (default: op)
    custom: Callable[[], Any] | None = None  # a thunk for calls that are not a baseline + delta


def opnd(name: str) -> str:
    return f"operand '{name}'"


def attr(name: str) -> str:
    return f"attribute '{name}'"


RP, RPS, PP = "mo.mha.ragged.paged", "mo.mha.ragged.paged.sink_weights", "mo.mha.padded.paged"
RN, PN, GN = "mo.mha.ragged.no_cache", "mo.mha.padded.no_cache", "mo.mha.decode.get_num_partitions"
AT, IX = "mo.msa.attention.ragged.paged", "mo.msa.indexer.ragged.paged"
ST, RO = "mo.kv_cache.store.ragged.paged", "mo.kv_cache.row_offsets.ragged.paged"

SWC = {"mask_str": "sliding_window_causal", "local_window_size": 4}

CASES: list[Case] = [
    # ---- mo.mha.ragged.paged ----------------------------------------------------------------------------
    Case("rp-q-rank2", RP, "wrapper", (opnd("q"), "rank 3"), operands={"q": S((T, H * D), BF16)}),
    Case("rp-q-int-dtype", RP, "call", (opnd("q"), "int32"), operands={"q": S((T, H, D), I32)}),
    Case(
        "rp-heads-not-divisible",
        RP,
        "call",
        (opnd("q"), "kv_blocks", "divisible", "H = 7"),
        operands={"q": S((T, 7, D), BF16)},
    ),
    Case(
        "rp-head-dim-mismatch",
        RP,
        "wrapper",
        (opnd("kv_blocks"), "head_dim"),
        operands={"kv_blocks": S((NB, 2, L, P, HKV, 32), BF16)},
    ),
    Case(
        "rp-kv-axis1-is-3",
        RP,
        "call",
        (opnd("kv_blocks"), "axis 1"),
        operands={"kv_blocks": S((NB, 3, L, P, HKV, D), BF16)},
    ),
    Case(
        "rp-kv-rank5",
        RP,
        "wrapper",
        (opnd("kv_blocks"), "rank 6"),
        operands={"kv_blocks": S((NB, 2, P, HKV, D), BF16)},
    ),
    Case(
        "rp-kv-dtype-ne-q",
        RP,
        "wrapper",
        (opnd("kv_blocks"), "bfloat16", "float16"),
        operands={"kv_blocks": S((NB, 2, L, P, HKV, D), F16)},
    ),
    Case(
        "rp-offsets-float32",
        RP,
        "wrapper",
        (opnd("input_row_offsets"), "float32"),
        operands={"input_row_offsets": S((B + 1,), F32)},
    ),
    Case(
        "rp-offsets-2d",
        RP,
        "call",
        (opnd("input_row_offsets"), "rank 1"),
        operands={"input_row_offsets": S((B + 1, 1), I32)},
    ),
    Case(
        "rp-cache-lengths-float",
        RP,
        "call",
        (opnd("cache_lengths"), "float32"),
        operands={"cache_lengths": S((B,), F32)},
    ),
    Case(
        "rp-cache-lengths-batch",
        RP,
        "call",
        (opnd("cache_lengths"),),
        operands={"cache_lengths": S((B + 1,), I32)},
    ),
    Case(
        "rp-lookup-batch",
        RP,
        "wrapper",
        (opnd("kv_lookup_table"),),
        operands={"kv_lookup_table": S((B + 1, MP), I32)},
    ),
    Case(
        "rp-layer-idx-vector",
        RP,
        "wrapper",
        (opnd("layer_idx"), "scalar"),
        operands={"layer_idx": S((1,), I32)},
    ),
    Case(
        "rp-layer-idx-float", RP, "call", (opnd("layer_idx"), "float32"), operands={"layer_idx": S((), F32)}
    ),
    Case("rp-layer-idx-none", RP, "wrapper", (opnd("layer_idx"), "None"), operands={"layer_idx": None}),
    Case(
        "rp-sliding-window-causal-no-window",
        RP,
        "wrapper",
        (attr("local_window_size"), "sliding_window_causal"),
        attrs={"local_window_size": -1},
        context=SWC,
    ),
    Case(
        "rp-sliding-window-noncausal-window0",
        RP,
        "call",
        (attr("local_window_size"), "sliding_window_noncausal"),
        attrs={"local_window_size": 0},
        context={"mask_str": "sliding_window_noncausal", "local_window_size": 4},
    ),
    Case(
        "rp-chunked-causal-no-window",
        RP,
        "wrapper",
        (attr("local_window_size"), "chunked_causal"),
        attrs={"local_window_size": -1},
        context={"mask_str": "chunked_causal", "local_window_size": 8},
    ),
    Case(
        "rp-window-float",
        RP,
        "wrapper",
        (attr("local_window_size"), "an int"),
        attrs={"local_window_size": 4.0},
        context=SWC,
    ),
    Case(
        "rp-window-past-int64",  # the native handlers take it as an int64 attribute
        RP,
        "call",
        (attr("local_window_size"), "int64", "9223372036854775808"),
        attrs={"local_window_size": 2**63},
        context=SWC,
    ),
    Case(
        "rp-window-past-int64-causal",  # ignored by the mask, but still an int64 attribute
        RP,
        "wrapper",
        (attr("local_window_size"), "int64"),
        attrs={"local_window_size": -(2**63) - 1},
    ),
    Case("rp-bad-mask", RP, "call", (attr("mask_str"), "diagonal"), attrs={"mask_str": "diagonal"}),
    Case("rp-mask-not-str", RP, "wrapper", (attr("mask_str"),), attrs={"mask_str": 1}),
    Case("rp-mask-missing", RP, "call", (attr("mask_str"), "required"), attrs={"mask_str": DROP}),
    Case("rp-scale-string", RP, "call", (attr("scale"),), attrs={"scale": "0.125"}),
    Case("rp-scale-nan", RP, "wrapper", (attr("scale"), "nan"), attrs={"scale": math.nan}),
    Case(
        "rp-num-partitions-negative",
        RP,
        "call",
        (attr("num_partitions"), "-1"),
        attrs={"num_partitions": -1},
    ),
    Case(
        "rp-num-partitions-too-large",
        RP,
        "wrapper",
        (attr("num_partitions"), "65"),
        attrs={"num_partitions": 65},
    ),
    Case(
        "rp-num-partitions-float",
        RP,
        "call",
        (attr("num_partitions"), "an int"),
        attrs={"num_partitions": 2.0},
    ),
    Case("rp-unknown-attr", RP, "call", ("unknown attribute", "'foo'"), attrs={"foo": 1}),
    Case(
        "rp-bad-implementation",
        RP,
        "wrapper",
        (attr("implementation"), "cuda"),
        attrs={"implementation": "cuda"},
    ),
    Case(
        "rp-hint-negative", RP, "wrapper", (attr("max_prompt_length"), "-1"), attrs={"max_prompt_length": -1}
    ),
    Case("rp-hint-string", RP, "call", (attr("max_cache_length"),), attrs={"max_cache_length": "128"}),
    Case("rp-missing-operand", RP, "call", ("expected 6 operands", "got 5"), operands={"layer_idx": DROP}),
    # ---- mo.mha.ragged.paged.sink_weights ---------------------------------------------------------------
    Case(
        "rps-sink-wrong-length",
        RPS,
        "wrapper",
        (opnd("sink_weights"),),
        operands={"sink_weights": S((H + 1,), BF16)},
    ),
    Case(
        "rps-sink-wrong-dtype",
        RPS,
        "call",
        (opnd("sink_weights"), "float32"),
        operands={"sink_weights": S((H,), F32)},
    ),
    Case(
        "rps-sink-rank2",
        RPS,
        "call",
        (opnd("sink_weights"), "rank 1"),
        operands={"sink_weights": S((1, H), BF16)},
    ),
    Case(
        "rps-heads-not-divisible",
        RPS,
        "wrapper",
        (opnd("q"), "divisible"),
        operands={"kv_blocks": S((NB, 2, L, P, 3, D), BF16)},
    ),
    Case(
        "rps-missing-sink-operand",
        RPS,
        "call",
        ("expected 7 operands", "sink_weights", "got 6"),
        operands={"sink_weights": DROP},
    ),
    Case(
        "rps-window-missing",
        RPS,
        "call",
        (attr("local_window_size"),),
        attrs={"local_window_size": -1},
        context=SWC,
    ),
    # ---- mo.mha.padded.paged ----------------------------------------------------------------------------
    Case("pp-q-rank3", PP, "wrapper", (opnd("q"), "rank 4"), operands={"q": S((B * SS, H, D), F16)}),
    Case(
        "pp-valid-lengths-wrong-length",
        PP,
        "call",
        (opnd("valid_lengths"),),
        operands={"valid_lengths": S((B + 1,), I32)},
    ),
    Case(
        "pp-valid-lengths-float",
        PP,
        "wrapper",
        (opnd("valid_lengths"), "float32"),
        operands={"valid_lengths": S((B,), F32)},
    ),
    Case(
        "pp-lookup-batch",
        PP,
        "call",
        (opnd("kv_lookup_table"),),
        operands={"kv_lookup_table": S((B + 1, MP), U32)},
    ),
    Case(
        "pp-head-dim-mismatch",
        PP,
        "wrapper",
        (opnd("kv_blocks"), "head_dim"),
        operands={"kv_blocks": S((NB, 2, L, P, HKV, 128), F16)},
    ),
    Case(
        "pp-chunked-window0",
        PP,
        "call",
        (attr("local_window_size"), "chunked_causal"),
        attrs={"local_window_size": 0},
        context={"mask_str": "chunked_causal", "local_window_size": 16},
    ),
    Case(
        "pp-num-partitions-negative", PP, "wrapper", (attr("num_partitions"),), attrs={"num_partitions": -3}
    ),
    Case("pp-layer-idx-vector", PP, "call", (opnd("layer_idx"),), operands={"layer_idx": S((L,), I32)}),
    Case(
        "pp-unknown-hint",
        PP,
        "wrapper",
        ("unknown attribute", "'max_prompt_len'"),
        attrs={"max_prompt_len": 5},
    ),
    # ---- mo.mha.ragged.no_cache -------------------------------------------------------------------------
    Case(
        "rn-heads-not-divisible",
        RN,
        "call",
        (opnd("q"), "'k'", "divisible"),
        operands={"k": S((T + 3, 3, D), F32), "v": S((T + 3, 3, D), F32)},
    ),
    Case(
        "rn-head-dim-mismatch",
        RN,
        "wrapper",
        (opnd("k"), "head_dim"),
        operands={"k": S((T + 3, HKV, 32), F32), "v": S((T + 3, HKV, 32), F32)},
    ),
    Case("rn-v-shape-ne-k", RN, "call", (opnd("v"),), operands={"v": S((T + 2, HKV, D), F32)}),
    Case(
        "rn-k-dtype-ne-q",
        RN,
        "wrapper",
        (opnd("k"), "float32", "bfloat16"),
        operands={"k": S((T + 3, HKV, D), BF16)},
    ),
    Case(
        "rn-kv-offsets-batch",
        RN,
        "wrapper",
        (opnd("kv_input_row_offsets"),),
        operands={"kv_input_row_offsets": S((B + 2,), I32)},
    ),
    Case(
        "rn-offsets-float",
        RN,
        "call",
        (opnd("input_row_offsets"), "float32"),
        operands={"input_row_offsets": S((B + 1,), F32)},
    ),
    Case(
        "rn-num-partitions-not-an-attr",
        RN,
        "call",
        ("unknown attribute", "'num_partitions'"),
        attrs={"num_partitions": 2},
    ),
    Case(
        "rn-sliding-window-missing",
        RN,
        "wrapper",
        (attr("local_window_size"),),
        attrs={"local_window_size": DROP},
        context=SWC,
    ),
    Case("rn-scale-inf", RN, "call", (attr("scale"), "inf"), attrs={"scale": math.inf}),
    # ---- mo.mha.padded.no_cache -------------------------------------------------------------------------
    Case(
        "pn-k-batch-mismatch",
        PN,
        "wrapper",
        (opnd("k"), "B of 'q'"),
        operands={"k": S((SB + 1, SK, HKV, D), BF16), "v": S((SB + 1, SK, HKV, D), BF16)},
    ),
    Case(
        "pn-valid-length-wrong-length",
        PN,
        "call",
        (opnd("valid_length"),),
        operands={"valid_length": S((SB + 1,), I32)},
    ),
    Case(
        "pn-valid-length-float",
        PN,
        "wrapper",
        (opnd("valid_length"), "float32"),
        operands={"valid_length": S((SB,), F32)},
    ),
    Case("pn-q-rank3", PN, "call", (opnd("q"), "rank 4"), operands={"q": S((SB * SS, H, D), BF16)}),
    Case(
        "pn-heads-not-divisible",
        PN,
        "wrapper",
        (opnd("q"), "divisible"),
        operands={"q": S((SB, SS, 5, D), BF16)},
    ),
    Case(
        "pn-bad-mask",
        PN,
        "wrapper",
        (attr("mask_str"), "upper_triangular"),
        attrs={"mask_str": "upper_triangular"},
    ),
    # ---- mo.mha.decode.get_num_partitions ---------------------------------------------------------------
    Case("gn-n-kv-heads-missing", GN, "call", (attr("n_kv_heads"), "required"), attrs={"n_kv_heads": DROP}),
    Case("gn-n-kv-heads-none", GN, "wrapper", (attr("n_kv_heads"),), attrs={"n_kv_heads": None}),
    Case("gn-n-kv-heads-float", GN, "call", (attr("n_kv_heads"), "an int"), attrs={"n_kv_heads": 2.0}),
    Case("gn-sm-count-0", GN, "wrapper", (attr("sm_count"), "0"), attrs={"sm_count": 0}),
    # The native handlers take both as int64 attributes: past it, a named error at trace time, not at lowering.
    Case("gn-n-kv-heads-past-int64", GN, "call", (attr("n_kv_heads"), str(2**63)), attrs={"n_kv_heads": 2**63}),
    Case("gn-sm-count-past-int64", GN, "wrapper", (attr("sm_count"), str(2**64)), attrs={"sm_count": 2**64}),
    Case("gn-batch-vector", GN, "call", (opnd("batch"), "scalar"), operands={"batch": S((B,), I32)}),
    Case(
        "gn-length-float",
        GN,
        "wrapper",
        (opnd("max_cache_valid_length"), "float32"),
        operands={"max_cache_valid_length": S((), F32)},
    ),
    Case("gn-unknown-attr", GN, "call", ("unknown attribute", "'mask_str'"), attrs={"mask_str": "causal"}),
    Case(
        "gn-too-many-operands", GN, "call", ("expected 2 operands", "got 3"), operands={"extra": S((), I32)}
    ),
    # ---- mo.msa.attention.ragged.paged ------------------------------------------------------------------
    Case("msa-head-dim-64", AT, "wrapper", (opnd("q"), "128"), operands={"q": S((T, H, 64), BF16)}),
    Case(
        "msa-page-size-64",
        AT,
        "call",
        (opnd("kv_blocks"), "page_size"),
        operands={"kv_blocks": S((MNB, 2, L, 64, HKV, MD), BF16)},
    ),
    Case(
        "msa-q-bf16-kv-fp8",
        AT,
        "wrapper",
        (opnd("kv_blocks"), "float8_e4m3fn", "bfloat16"),
        operands={"kv_blocks": S((MNB, 2, L, 128, HKV, MD), FP8)},
    ),
    Case("msa-q-f32", AT, "call", (opnd("q"), "float32"), operands={"q": S((T, H, MD), F32)}),
    Case(
        "msa-d-indices-kv-heads",
        AT,
        "wrapper",
        (opnd("d_indices"), "n_kv_heads"),
        operands={"d_indices": S((HKV + 1, T, TOPK), I32)},
    ),
    Case(
        "msa-d-indices-T",
        AT,
        "call",
        (opnd("d_indices"), "T"),
        operands={"d_indices": S((HKV, T - 1, TOPK), I32)},
    ),
    Case(
        "msa-d-indices-float",
        AT,
        "wrapper",
        (opnd("d_indices"), "float32"),
        operands={"d_indices": S((HKV, T, TOPK), F32)},
    ),
    Case(
        "msa-d-indices-rank2",
        AT,
        "call",
        (opnd("d_indices"), "rank 3"),
        operands={"d_indices": S((T, TOPK), I32)},
    ),
    Case("msa-d-indices-none", AT, "wrapper", (opnd("d_indices"), "None"), operands={"d_indices": None}),
    Case(
        "msa-cache-row-offsets-length",
        AT,
        "wrapper",
        (opnd("cache_row_offsets"),),
        operands={"cache_row_offsets": S((B + 2,), I32)},
    ),
    Case(
        "msa-heads-not-divisible", AT, "call", (opnd("q"), "divisible"), operands={"q": S((T, 3, MD), BF16)}
    ),
    Case(
        "msa-kv-axis1-is-1",
        AT,
        "wrapper",
        (opnd("kv_blocks"), "axis 1"),
        operands={"kv_blocks": S((MNB, 1, L, 128, HKV, MD), BF16)},
    ),
    Case(
        "msa-lookup-batch",
        AT,
        "call",
        (opnd("kv_lookup_table"),),
        operands={"kv_lookup_table": S((1, MP_), I32)},
    ),
    Case(
        "msa-layer-idx-float",
        AT,
        "wrapper",
        (opnd("layer_idx"), "float32"),
        operands={"layer_idx": S((), F32)},
    ),
    Case(
        "msa-mask-str-not-an-attr",
        AT,
        "call",
        ("unknown attribute", "'mask_str'"),
        attrs={"mask_str": "causal"},
    ),
    Case(
        "msa-num-partitions-too-large",
        AT,
        "wrapper",
        (attr("num_partitions"),),
        attrs={"num_partitions": 1000},
    ),
    Case("msa-scale-nan", AT, "call", (attr("scale"),), attrs={"scale": float("nan")}),
    Case("msa-hint-negative", AT, "call", (attr("max_prompt_length"), "-1"), attrs={"max_prompt_length": -1}),
    # An omitted cache_row_offsets is filled from the operands it would be derived from; a float cache_lengths
    # must still be reported as a fault of the op the user called.
    Case(
        "msa-derived-row-offsets-float-cache-lengths",
        AT,
        "wrapper",
        (opnd("cache_lengths"), "float32"),
        operands={"cache_lengths": S((B,), F32)},
    ),
    Case(
        "msa-omitted-row-offsets-float-cache-lengths",
        AT,
        "call",
        (opnd("cache_lengths"), "float32"),
        operands={"cache_lengths": S((B,), F32)},
    ),
    # ---- mo.msa.indexer.ragged.paged --------------------------------------------------------------------
    Case("ix-topk-missing", IX, "call", (attr("topk"), "required"), attrs={"topk": DROP}),
    Case(
        "ix-topk-0",
        IX,
        "wrapper",
        (attr("topk"), "0"),
        attrs={"topk": 0, "init_blocks": 0, "local_blocks": 0},
    ),
    Case("ix-topk-float", IX, "call", (attr("topk"), "an int"), attrs={"topk": 4.0}),
    Case(
        "ix-init-plus-local-gt-topk",
        IX,
        "wrapper",
        (attr("init_blocks + local_blocks"), "topk"),
        attrs={"init_blocks": 3, "local_blocks": 2},
    ),
    Case("ix-init-negative", IX, "wrapper", (attr("init_blocks"),), attrs={"init_blocks": -1}),
    Case(
        "ix-k-blocks-axis4-2",
        IX,
        "call",
        (opnd("k_blocks"), "axis 4"),
        operands={"k_blocks": S((MNB, 1, L, 128, 2, DI), BF16)},
    ),
    Case(
        "ix-k-blocks-axis1-2",
        IX,
        "wrapper",
        (opnd("k_blocks"), "axis 1"),
        operands={"k_blocks": S((MNB, 2, L, 128, 1, DI), BF16)},
    ),
    Case(
        "ix-di-mismatch",
        IX,
        "wrapper",
        (opnd("k_blocks"), "Di"),
        operands={"k_blocks": S((MNB, 1, L, 128, 1, DI * 2), BF16)},
    ),
    Case(
        "ix-page-size-64",
        IX,
        "call",
        (opnd("k_blocks"), "page_size"),
        operands={"k_blocks": S((MNB, 1, L, 64, 1, DI), BF16)},
    ),
    Case(
        "ix-k-blocks-dtype-ne-q",
        IX,
        "call",
        (opnd("k_blocks"), "float32"),
        operands={"k_blocks": S((MNB, 1, L, 128, 1, DI), F32)},
    ),
    Case(
        "ix-k-cache-lengths-batch",
        IX,
        "wrapper",
        (opnd("k_cache_lengths"),),
        operands={"k_cache_lengths": S((B + 1,), I32)},
    ),
    Case(
        "ix-k-lookup-float",
        IX,
        "call",
        (opnd("k_lookup_table"), "float32"),
        operands={"k_lookup_table": S((B, MP_), F32)},
    ),
    Case("ix-layer-idx-vector", IX, "wrapper", (opnd("layer_idx"),), operands={"layer_idx": S((2,), I32)}),
    Case("ix-q-rank2", IX, "call", (opnd("q"), "rank 3"), operands={"q": S((T, DI), BF16)}),
    Case("ix-scale-string", IX, "call", (attr("scale"),), attrs={"scale": "auto"}),
    # ---- mo.kv_cache.store.ragged.paged -----------------------------------------------------------------
    Case(
        "st-k-dtype-ne-kv",
        ST,
        "wrapper",
        (opnd("k"), "float32", "bfloat16"),
        operands={"k": S((T, HKV, D), F32)},
    ),
    Case("st-v-shape-ne-k", ST, "call", (opnd("v"),), operands={"v": S((T - 1, HKV, D), BF16)}),
    Case(
        "st-k-heads-mismatch",
        ST,
        "wrapper",
        (opnd("k"), "n_kv_heads"),
        operands={"k": S((T, HKV + 1, D), BF16), "v": S((T, HKV + 1, D), BF16)},
    ),
    Case(
        "st-k-head-dim-mismatch",
        ST,
        "call",
        (opnd("k"), "head_dim"),
        operands={"k": S((T, HKV, D // 2), BF16), "v": S((T, HKV, D // 2), BF16)},
    ),
    Case(
        "st-kv-axis1-is-1",
        ST,
        "wrapper",
        (opnd("kv_blocks"), "axis 1"),
        operands={"kv_blocks": S((NB, 1, L, P, HKV, D), BF16)},
    ),
    Case(
        "st-cache-lengths-batch",
        ST,
        "call",
        (opnd("cache_lengths"),),
        operands={"cache_lengths": S((B - 1,), I32)},
    ),
    Case(
        "st-layer-idx-float",
        ST,
        "wrapper",
        (opnd("layer_idx"), "float32"),
        operands={"layer_idx": S((), F32)},
    ),
    Case(
        "st-offsets-float",
        ST,
        "wrapper",
        (opnd("input_row_offsets"), "float32"),
        operands={"input_row_offsets": S((B + 1,), F32)},
    ),
    Case("st-unknown-attr", ST, "call", ("unknown attribute", "'mask_str'"), attrs={"mask_str": "causal"}),
    Case(
        "st-head-dim-0",
        ST,
        "call",
        (opnd("kv_blocks"), "head_dim >= 1"),
        operands={"kv_blocks": S((NB, 2, L, P, HKV, 0), BF16)},
    ),
    Case(
        "st-kv-heads-0",
        ST,
        "wrapper",
        (opnd("kv_blocks"), "n_kv_heads >= 1"),
        operands={"kv_blocks": S((NB, 2, L, P, 0, D), BF16)},
    ),
    Case(
        "st-bad-implementation",
        ST,
        "call",
        (attr("implementation"), "fast"),
        attrs={"implementation": "fast"},
    ),
    # ---- mo.kv_cache.row_offsets.ragged.paged -----------------------------------------------------------
    Case(
        "ro-offsets-2d",
        RO,
        "wrapper",
        (opnd("input_row_offsets"), "rank 1"),
        operands={"input_row_offsets": S((1, B + 1), I32)},
    ),
    Case(
        "ro-offsets-empty",
        RO,
        "call",
        (opnd("input_row_offsets"), "at least one"),
        operands={"input_row_offsets": S((0,), I32), "cache_lengths": S((0,), U32)},
    ),
    Case(
        "ro-cache-lengths-batch",
        RO,
        "call",
        (opnd("cache_lengths"),),
        operands={"cache_lengths": S((B + 1,), U32)},
    ),
    Case(
        "ro-cache-lengths-float",
        RO,
        "wrapper",
        (opnd("cache_lengths"), "float32"),
        operands={"cache_lengths": S((B,), F32)},
    ),
    Case("ro-unknown-attr", RO, "call", ("unknown attribute", "'scale'"), attrs={"scale": 1.0}),
    # ---- registry -------------------------------------------------------------------------------------
    Case(
        "unknown-op-get_op",
        "mo.mha.ragged.paged.bogus",
        "call",
        ("unknown op 'mo.mha.ragged.paged.bogus'",),
        custom=lambda: msa_ops.get_op("mo.mha.ragged.paged.bogus"),
    ),
    Case("unknown-op-call", "mo.attention", "call", ("unknown op 'mo.attention'",), call_name="mo.attention"),
    Case(
        "unknown-op-call-with-attrs",
        "mo.msa.attention",
        "call",
        ("unknown op 'mo.msa.attention'",),
        call_name="mo.msa.attention",
        attrs={"topk": 4},
    ),
    Case(
        "op-name-unhashable",
        "['mo.mha.ragged.paged']",
        "call",
        ("unknown op",),
        custom=lambda: msa_ops.get_op(["mo.mha.ragged.paged"]),
    ),
]

# These cases pass cache_row_offsets=None, to the wrapper and to the call by name.
_NONE_CRO = {"msa-derived-row-offsets-float-cache-lengths", "msa-omitted-row-offsets-float-cache-lengths"}


# ---------------------------------------------------------------------------------------------------------
# Running a case
# ---------------------------------------------------------------------------------------------------------
def _merge(base: dict, delta: dict) -> dict:
    out = dict(base)
    for k, v in delta.items():
        if v is DROP:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def build(case: Case, *, good: bool) -> Callable[[], Any]:
    """A thunk evaluating the case (or, with good=True, its twin) with jax.eval_shape."""
    if case.custom is not None:
        if good:
            return lambda: msa_ops.get_op(RP)
        return lambda: jax.eval_shape(lambda: case.custom())
    base_op = case.op if case.op in BASELINES else RP
    base = BASELINES[base_op]
    operands = dict(base["operands"])
    if case.id in _NONE_CRO:
        operands["cache_row_offsets"] = None
    attrs = _merge(base["attrs"], case.context)
    if not good:
        operands = _merge(operands, case.operands)
        attrs = _merge(attrs, case.attrs)
    name = base_op if good else (case.call_name or case.op)
    structs = [v for v in operands.values() if isinstance(v, S)]

    def f(*xs):
        it = iter(xs)
        vals = {k: (next(it) if isinstance(v, S) else v) for k, v in operands.items()}
        if case.via == "call":
            return msa_ops.call(name, *vals.values(), **attrs)
        return WRAPPERS[base_op](**vals, **attrs)

    return lambda: jax.eval_shape(f, *structs)


def check_bad(case: Case) -> BaseException:
    with pytest.raises(msa_ops.MsaOpsError) as ei:
        build(case, good=False)()
    e = ei.value
    msg = str(e)
    assert isinstance(e, (ValueError, TypeError)), (
        f"{type(e).__mro__} is neither ValueError nor TypeError: {msg}"
    )
    assert case.op in msg, f"message does not name the op {case.op!r}: {msg}"
    for s in case.names:
        assert s in msg, f"message does not contain {s!r}: {msg}"
    return e


# ---------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------
def _params():
    return [pytest.param(c, id=c.id) for c in CASES]


@pytest.mark.parametrize("case", _params())
def test_malformed_rejected(case: Case):
    check_bad(case)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_good_twin(case: Case):
    """The same call without the fault traces (so each case isolates exactly its fault)."""
    out = build(case, good=True)()
    if case.custom is not None:
        return
    base_op = case.op if case.op in BASELINES else RP
    shape, dtype = BASELINES[base_op]["out"]
    assert tuple(out.shape) == shape and out.dtype == jnp.dtype(dtype), out


def test_catalogue_coverage():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    assert len(CASES) >= 40
    ops = set(msa_ops.list_ops())
    assert ops == set(BASELINES), "BASELINES must cover exactly the registered ops"
    for name in ops:
        assert tuple(BASELINES[name]["operands"]) == tuple(msa_ops.get_op(name).operands), name
        for via in ("wrapper", "call"):
            assert any(c.op == name and c.via == via for c in CASES), f"no {via} case for {name}"


def test_faults_are_minimal():
    """Each case has a fault, and changes one operand (or a k/v pair, or the offsets/lengths pair of an empty
    batch) or a few attributes of one concern; a dropped attribute exists in the twin."""
    for c in CASES:
        if c.custom is not None or c.call_name is not None:
            continue
        base_attrs = {**BASELINES[c.op]["attrs"], **c.context}
        assert c.operands or c.attrs, c.id
        for k, v in c.attrs.items():
            assert v is not DROP or k in base_attrs, (c.id, k)
        assert len(c.operands) + len(c.attrs) <= 3, c.id
        changed = set(c.operands)
        assert len(changed) <= 1 or changed in ({"k", "v"}, {"input_row_offsets", "cache_lengths"}), c.id


def test_no_case_crashes_the_process():
    """Run the whole catalogue (bad calls and their good twins) in a fresh interpreter: every bad call raises a
    Python exception (no abort / segfault / hang) and every twin traces."""
    code = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("tm", {__file__!r})
        m = importlib.util.module_from_spec(spec)
        sys.modules["tm"] = m
        spec.loader.exec_module(m)
        n = 0
        for c in m.CASES:
            try:
                m.build(c, good=False)()
            except Exception:
                n += 1
            else:
                print("NORAISE", c.id)
            m.build(c, good=True)()
        print("RAISED", n, "OF", len(m.CASES))
    """)
    from conftest import child_env  # here, not at the top: the child loads this file with no tests/ on its path

    env = child_env()
    r = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    assert f"RAISED {len(CASES)} OF {len(CASES)}" in r.stdout, r.stdout[-4000:]
