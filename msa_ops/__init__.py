"""msa_ops: the attention ops of an LLM inference engine as JAX primitives.

Every op is registered under its MAX graph-op name; see ``list_ops()``. Call by name with
``call(name, *operands, **attrs)`` or through the wrappers below.
"""

from __future__ import annotations

from . import routing
from .api import (
    kv_cache_row_offsets_ragged_paged,
    kv_cache_store_ragged_paged,
    mha_decode_get_num_partitions,
    mha_padded_no_cache,
    mha_padded_paged,
    mha_ragged_no_cache,
    mha_ragged_paged,
    msa_attention_ragged_paged,
    msa_indexer_ragged_paged,
)
from .errors import (
    MsaOpsError,
    NativeUnavailableError,
    OpAttributeError,
    OpDtypeError,
    OpShapeError,
)
from .ops import kv_cache as _kv_cache  # noqa: F401  (registers ops)
from .ops import mha as _mha  # noqa: F401
from .ops import msa as _msa  # noqa: F401
from .registry import (
    IMPLEMENTATION_ENV,
    OpDef,
    assume_native,
    call,
    export_safety_checks,
    get_op,
    list_ops,
    plan,
    resolve_implementation,
)
from .routing import Plan

__version__ = "0.1.0"

__all__ = [
    "IMPLEMENTATION_ENV", "MsaOpsError", "NativeUnavailableError", "OpAttributeError", "OpDef", "OpDtypeError",
    "OpShapeError", "Plan", "assume_native", "call", "export_safety_checks", "get_op",
    "kv_cache_row_offsets_ragged_paged", "kv_cache_store_ragged_paged", "list_ops", "mha_decode_get_num_partitions",
    "mha_padded_no_cache", "mha_padded_paged", "mha_ragged_no_cache", "mha_ragged_paged", "msa_attention_ragged_paged",
    "msa_indexer_ragged_paged", "plan", "resolve_implementation", "routing",
]
