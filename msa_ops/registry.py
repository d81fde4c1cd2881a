"""The op registry: one JAX primitive per MAX graph op, with its shape rule, lowerings and batching rule."""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import PartitionSpec

from .errors import NativeUnavailableError, OpAttributeError, OpDtypeError, OpShapeError
from .fold import FOLDS
from .sharding import explicit_spec, reshard, run_head_parallel

IMPLEMENTATIONS = ("auto", "reference", "native")
IMPLEMENTATION_ENV = "MSA_OPS_IMPLEMENTATION"
FOLD_ENV = "MSA_OPS_VMAP_FOLD"  # "0": every vmap takes the lax.map rule (read when a call is batched)

# Platforms whose lowering may emit a native custom call even though this process has not loaded the
# platform's library (cross-lowering with jax.export).
_ASSUME_NATIVE: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "msa_ops_assume_native", default=frozenset()
)


@dataclass(frozen=True)
class Attrs:
    """Normalized, hashable attributes of one op call (bound as a primitive parameter)."""

    items: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, d: Mapping[str, Any]) -> Attrs:
        return cls(tuple(sorted(d.items())))

    def __getattr__(self, name: str) -> Any:
        for k, v in object.__getattribute__(self, "items"):
            if k == name:
                return v
        raise AttributeError(name)


@dataclass(frozen=True)
class OpDef:
    """Everything the library knows about one op.

    ``abstract(*avals, attrs) -> tuple[ShapedArray, ...]`` checks shapes/dtypes and returns result avals
    (the first is the op's output; any further ones are split-K workspace).
    ``reference(*arrays, attrs)`` and ``native(*arrays, attrs, platform)`` return tuples of arrays of those avals
    (``platform``: 'cpu' or 'cuda', for a native lowering that differs between them, like the CUDA indexer's
    workspace).
    """

    name: str
    operands: tuple[str, ...]
    attr_defaults: Mapping[str, Any]
    normalize: Callable[[dict[str, Any]], dict[str, Any]]
    abstract: Callable[..., tuple[Any, ...]]
    reference: Callable[..., tuple[Any, ...]]
    native: Callable[..., tuple[Any, ...]] | None
    ffi_target: str | None
    plan: Callable[..., Any] | None = None
    native_supports: Callable[..., str | None] | None = None  # -> None if supported, else the reason
    doc: str = ""
    # Operands SPEC.md lets a caller leave out: name -> fill(operands by name, None where not given) -> the value
    # used. ``call`` accepts them as None or, with positional operands one short per omission, left out.
    operand_defaults: Mapping[str, Callable[[dict[str, Any]], Any]] = field(default_factory=dict)
    primitive: Primitive = field(default=None, repr=False)  # type: ignore[assignment]
    batching: Callable[..., Any] | None = field(default=None, repr=False)  # the vmap rule


_REGISTRY: dict[str, OpDef] = {}


def list_ops() -> list[str]:
    """Names of every registered op (MAX graph-op names)."""
    return sorted(_REGISTRY)


def get_op(name: str) -> OpDef:
    """The definition of one op by its MAX name."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise OpAttributeError(f"unknown op {name!r}; registered: {', '.join(list_ops())}") from None


@contextlib.contextmanager
def assume_native(*platforms: str) -> Iterator[None]:
    """Lower to the native custom calls of ``platforms`` even where their library is not loaded here.

    For cross-lowering with ``jax.export`` (e.g. exporting a CUDA module on a CPU-only machine); the
    exported module runs only where the library is loaded. Only lowerings made inside the context are
    affected: jit caches a lowering per traced function, so trace a fresh function inside it.
    """
    tok = _ASSUME_NATIVE.set(_ASSUME_NATIVE.get() | frozenset(platforms))
    try:
        yield
    finally:
        _ASSUME_NATIVE.reset(tok)


def export_safety_checks() -> list[Any]:
    """``jax.export.DisabledSafetyCheck`` entries for every native custom-call target of msa_ops.

    ``jax.export.export`` refuses to serialize custom calls that have no compatibility guarantee unless told
    otherwise: pass these as its ``disabled_checks`` for a graph whose ops lower to their native handlers. The
    exported module runs where msa_ops is imported with the same version's libraries loaded (the handlers are
    registered under these names when the library loads; their attributes and operand order are this version's).
    """
    from jax import export

    from ._native import TARGETS

    return [export.DisabledSafetyCheck.custom_call(t) for t in TARGETS]


def _requested(implementation: str) -> str:
    if implementation != "auto":
        return implementation
    env = os.environ.get(IMPLEMENTATION_ENV, "auto").strip().lower() or "auto"
    if env not in IMPLEMENTATIONS:
        raise OpAttributeError(f"{IMPLEMENTATION_ENV}={env!r}: expected one of {IMPLEMENTATIONS}")
    return env


def resolve_implementation(op: OpDef, platform: str | None, implementation: str, avals=(), attrs=None) -> str:
    """'reference' or 'native' for one op lowered on ``platform`` ('cpu', 'cuda' or None for others)."""
    req = _requested(implementation)
    if req == "reference":
        return "reference"
    reason: str | None = None
    if platform not in ("cpu", "cuda"):
        reason = f"no native library exists for platform {platform!r}"
    elif op.ffi_target is None or op.native is None:
        reason = "this op has no native handler"
    elif platform not in _ASSUME_NATIVE.get():
        try:
            from . import _native
        except ImportError as e:  # pragma: no cover - a broken install
            _native = None
            reason = f"msa_ops._native failed to import: {e}"
        if _native is None:
            pass
        elif not _native.available(platform):
            reason = _native.missing_reason(platform)
        elif op.ffi_target not in _native.registered_targets(platform):
            reason = f"the {platform} library does not export target {op.ffi_target!r}"
    if reason is None and op.native_supports is not None and attrs is not None:
        reason = op.native_supports(*avals, attrs=attrs, platform=platform)
    if reason is None:
        return "native"
    if req == "native":
        raise NativeUnavailableError(f"{op.name}: implementation='native' on {platform}: {reason}")
    return "reference"


def _lowering(ctx, *args, attrs: Attrs, implementation: str, op: OpDef, platform: str | None):
    impl = resolve_implementation(op, platform, implementation, ctx.avals_in, attrs)
    if impl == "native":
        assert op.native is not None
        fn = partial(op.native, attrs=attrs, platform=platform)
    else:
        fn = partial(op.reference, attrs=attrs)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _batch_rule(args, dims, *, attrs: Attrs, implementation: str, op: OpDef):
    """vmap: fold the mapped axis into the op's sequences where ``fold.py`` can (one call for every element),
    else run the op once per batch element (lax.map), unbatched operands shared. A mapped axis sharded over an
    explicit mesh axis is gathered first (lax.map scans it, and a scanned axis must be replicated); the operands'
    other axes keep their shardings."""
    folder = FOLDS.get(op.name)
    if folder is not None and os.environ.get(FOLD_ENV, "1").strip() != "0":
        # one element's shapes and dtypes checked as a call of the op checks them: the fold reshapes operands
        # before any bind sees them (the loop below binds each element, which checks it)
        op.abstract(*(ShapedArray(tuple(a.shape[:d]) + tuple(a.shape[d + 1:]) if d is not None else tuple(a.shape),
                                  a.dtype) for a, d in zip(args, dims)), attrs=attrs)

        def bind(*xs, attrs):
            return op.primitive.bind(*xs, attrs=attrs, implementation=implementation)

        folded = folder(args, dims, attrs=attrs, bind=bind)
        if folded is not None:
            return folded
    mapped = [i for i, d in enumerate(dims) if d is not None]  # None = not mapped
    moved = tuple(_replicate_axis0(jnp.moveaxis(args[i], dims[i], 0)) for i in mapped)

    def body(xs):
        full = list(args)
        for i, x in zip(mapped, xs):
            full[i] = x
        return tuple(op.primitive.bind(*full, attrs=attrs, implementation=implementation))

    outs = lax.map(body, moved)
    return list(outs), [0] * len(outs)


def _replicate_axis0(x):
    spec = explicit_spec(x)
    if spec is None or spec[0] is None:
        return x
    return reshard(x, PartitionSpec(None, *spec[1:]))


def _eager_impl(prim: Primitive) -> Callable[..., Any]:
    """Eager (outside jit) calls compile the primitive alone, cached per shapes and parameters."""
    try:
        from jax._src.dispatch import apply_primitive

        return partial(apply_primitive, prim)
    except ImportError:  # pragma: no cover - private API moved; fall back to a jitted bind
        cache: dict[Any, Callable[..., Any]] = {}

        def impl(*args, **params):
            key = tuple(sorted(params.items()))
            if key not in cache:
                cache[key] = jax.jit(partial(prim.bind, **params))
            return cache[key](*args)

        return impl


def register(op: OpDef) -> OpDef:
    if op.name in _REGISTRY:
        raise RuntimeError(f"op {op.name} registered twice")
    prim = Primitive(op.name)
    prim.multiple_results = True
    prim.def_impl(_eager_impl(prim))
    prim.def_abstract_eval(lambda *avals, attrs, implementation: op.abstract(*avals, attrs=attrs))
    for platform in ("cpu", "cuda"):
        mlir.register_lowering(prim, partial(_lowering, op=op, platform=platform), platform=platform)
    mlir.register_lowering(prim, partial(_lowering, op=op, platform=None))
    op = OpDef(**{**op.__dict__, "primitive": prim})
    rule = partial(_batch_rule, op=op)
    batching.primitive_batchers[prim] = rule
    op = OpDef(**{**op.__dict__, "batching": rule})
    _REGISTRY[op.name] = op
    return op


def normalize_call_attrs(op: OpDef, attrs: Mapping[str, Any]) -> tuple[Attrs, str]:
    attrs = dict(attrs)
    implementation = attrs.pop("implementation", "auto")
    if implementation not in IMPLEMENTATIONS:
        raise OpAttributeError(
            f"{op.name}: attribute 'implementation': expected one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    unknown = sorted(set(attrs) - set(op.attr_defaults))
    if unknown:
        raise OpAttributeError(
            f"{op.name}: unknown attribute(s) {unknown}; accepted: {sorted(op.attr_defaults)} and implementation"
        )
    full = {**op.attr_defaults, **attrs}
    return Attrs.of(op.normalize(full)), implementation


def call(name: str, *operands: Any, **attrs: Any):
    """Call an op by its MAX name with MAX's operand order; returns the op's output."""
    op = get_op(name)
    with _read_as_left_out(op, operands):
        operands = _fill_operands(op, operands)
        norm, implementation = normalize_call_attrs(op, attrs)
        arrays = [_as_array(name, n, x) for n, x in zip(op.operands, operands)]

        def run(*xs):
            return op.primitive.bind(*xs, attrs=norm, implementation=implementation)[0]

        out = run_head_parallel(run, name, op.operands, arrays)  # explicit head sharding: one op per shard
        return run(*arrays) if out is None else out


def _left_out(op: OpDef, operands: tuple[Any, ...]) -> list[str]:
    """The optional operands a call of this many operands is read as leaving out (none when all are given)."""
    optional = [n for n in op.operands if n in op.operand_defaults]
    return optional if optional and len(operands) == len(op.operands) - len(optional) else []


@contextlib.contextmanager
def _read_as_left_out(op: OpDef, operands: tuple[Any, ...]):
    """A shape or dtype error of a call that was one optional operand short says how its operands were read: a
    required operand forgotten reads the same way, and the error then names the operand after it."""
    left_out = _left_out(op, operands)
    try:
        yield
    except (OpShapeError, OpDtypeError) as e:
        if not left_out:
            raise
        given = [n for n in op.operands if n not in left_out]
        raise type(e)(
            f"{e} [{len(operands)} operands were read as {', '.join(given)}, with {', '.join(left_out)} left out; "
            f"the op takes {len(op.operands)}: {', '.join(op.operands)}]"
        ) from e


def _fill_operands(op: OpDef, operands: tuple[Any, ...]) -> list[Any]:
    """MAX's operand list, with the operands SPEC.md lets a caller omit (left out or None) filled in."""
    optional = [n for n in op.operands if n in op.operand_defaults]
    if _left_out(op, operands):
        given = iter(operands)
        operands = tuple(None if n in op.operand_defaults else next(given) for n in op.operands)
    if len(operands) != len(op.operands):
        may = f"; {', '.join(optional)} may be left out" if optional else ""
        raise OpShapeError(
            f"{op.name}: expected {len(op.operands)} operands ({', '.join(op.operands)}), got {len(operands)}{may}"
        )
    named = dict(zip(op.operands, operands))
    for n in optional:
        if named[n] is None:
            named[n] = op.operand_defaults[n](named)
    return [named[n] for n in op.operands]


def _as_array(op: str, operand: str, x: Any):
    if x is None:
        raise OpShapeError(f"{op}: operand '{operand}': expected an array, got None")
    if isinstance(x, jax.Array) or hasattr(x, "aval"):
        return x
    if isinstance(x, int) and not isinstance(x, bool) and -(2**31) <= x < 2**32:
        # A Python int (layer_idx=1): int32 whether or not jax_enable_x64 would make it int64.
        return jnp.asarray(x, jnp.int32 if x < 2**31 else jnp.uint32)
    try:
        return jnp.asarray(x)
    except Exception as e:
        raise OpShapeError(
            f"{op}: operand '{operand}': expected an array, got {type(x).__name__} {x!r:.80} ({e})"
        ) from e


def check_operands(op: str, operands: Mapping[str, Any]) -> None:
    """Offsets-like operands an op derives something from: int32/uint32 vectors, errors named for ``op``."""
    from .ops.common import Check

    c = Check(op)
    for name, x in operands.items():
        a = x if hasattr(x, "shape") and hasattr(x, "dtype") else _as_array(op, name, x)  # arrays or structs
        c.rank(name, a, 1, "[B+1]" if "offsets" in name else "[B]")
        c.ints(name, a)


def plan(name: str, *operands: Any, **attrs: Any):
    """The route (``routing.Plan``) a call with these operands (arrays or ShapeDtypeStructs) would take."""
    op = get_op(name)
    if op.plan is None:
        raise OpAttributeError(f"{name}: this op has a single elementwise route; no plan to inspect")
    with _read_as_left_out(op, operands):
        operands = _fill_operands(op, operands)
        norm, _ = normalize_call_attrs(op, attrs)
        shaped = [x if hasattr(x, "shape") and hasattr(x, "dtype") else _as_array(name, n, x)
                  for n, x in zip(op.operands, operands)]
        avals = [jax.core.ShapedArray(tuple(a.shape), a.dtype) for a in shaped]
        op.abstract(*avals, attrs=norm)  # same errors as a real call
        return op.plan(*avals, attrs=norm)

