"""One exception family for every error the library raises on behalf of an op."""

from __future__ import annotations


class MsaOpsError(Exception):
    """Base class of every msa_ops error."""


class OpShapeError(MsaOpsError, ValueError):
    """An operand has the wrong rank or shape."""


class OpDtypeError(MsaOpsError, TypeError):
    """An operand has the wrong dtype."""


class OpAttributeError(MsaOpsError, ValueError):
    """An attribute (keyword) is missing, unknown or out of range."""


class NativeUnavailableError(MsaOpsError, RuntimeError):
    """The native implementation was asked for where its library or target is missing."""


def operand_error(op: str, operand: str, expected: str, got: str) -> OpShapeError:
    return OpShapeError(f"{op}: operand '{operand}': expected {expected}, got {got}")


def dtype_error(op: str, operand: str, expected: str, got: object) -> OpDtypeError:
    return OpDtypeError(f"{op}: operand '{operand}': expected dtype {expected}, got {got}")


def attribute_error(op: str, attr: str, expected: str, got: object) -> OpAttributeError:
    return OpAttributeError(f"{op}: attribute '{attr}': expected {expected}, got {got!r}")
