"""Find, load and register the native XLA FFI libraries of msa_ops.

``libmsa_ops_cpu.so`` (always built) and ``libmsa_ops_cuda.so`` (built where nvcc is found) live next to this
package after ``pip install --no-build-isolation .``; a build directory can be pointed at with the environment
variable ``MSA_OPS_LIBRARY_DIR`` (searched first). Libraries are loaded lazily with ctypes on the first
``available(platform)`` call and each FFI target is registered with JAX once. Nothing here raises on a missing or
broken library: the reason is recorded and returned by ``missing_reason``.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "LIBRARY_NAMES",
    "TARGETS",
    "available",
    "info",
    "launch_counts",
    "library_dir_candidates",
    "missing_reason",
    "registered_targets",
]

# The FFI targets of docs/SEMANTICS.md, same names on every platform.
TARGETS: tuple[str, ...] = (
    "msa_ops_mha_ragged_paged",
    "msa_ops_mha_padded_paged",
    "msa_ops_mha_ragged_no_cache",
    "msa_ops_mha_padded_no_cache",
    "msa_ops_msa_attention",
    "msa_ops_msa_indexer",
    "msa_ops_kv_cache_store",
    "msa_ops_kv_cache_row_offsets",
    "msa_ops_get_num_partitions",
)

LIBRARY_NAMES: dict[str, str] = {"cpu": "libmsa_ops_cpu.so", "cuda": "libmsa_ops_cuda.so"}
# Platform names as XLA spells them for register_ffi_target.
_XLA_PLATFORM: dict[str, str] = {"cpu": "cpu", "cuda": "CUDA"}
ENV_LIBRARY_DIR = "MSA_OPS_LIBRARY_DIR"

_BUILD_HINT = (
    "build it with `pip install --no-build-isolation .` in the msa_ops source tree (needs cmake and a C++17 "
    "compiler; the CUDA library also needs nvcc), or build with CMake (`cmake -S kernels -B build "
    "-DPython_EXECUTABLE=$(which python) && cmake --build build`) and set "
    f"{ENV_LIBRARY_DIR}=<build dir>"
)


@dataclass
class _LibState:
    platform: str
    loaded: bool = False  # a load was attempted
    path: str | None = None
    handle: ctypes.CDLL | None = None
    reason: str | None = None  # why it is not available (None when it is)
    registered: list[str] = field(default_factory=list)
    version: str | None = None
    archs: str | None = None
    ffi_api_version: str | None = None
    missing: list[str] = field(default_factory=list)  # TARGETS the library does not export


_lock = threading.RLock()
_state: dict[str, _LibState] = {p: _LibState(p) for p in LIBRARY_NAMES}


def _normalize(platform: str) -> str:
    p = platform.lower()
    if p in ("gpu", "cuda"):
        return "cuda"
    return p


def _installed_package_dir() -> Path | None:
    """The msa_ops directory of the installed distribution, when it is not the one imported (a source tree
    on sys.path, e.g. `python -m msa_ops` run from the checkout, shadows the installed package)."""
    try:
        from importlib import metadata

        located = Path(str(metadata.distribution("msa_ops").locate_file("msa_ops"))).resolve()
    except Exception:  # noqa: BLE001 - not installed, or metadata unreadable: nothing to add
        return None
    return located if located.is_dir() else None


def library_dir_candidates() -> list[Path]:
    """Directories searched for the libraries, in order: $MSA_OPS_LIBRARY_DIR (os.pathsep-separated), this
    package's directory, then the installed distribution's package directory."""
    dirs: list[Path] = []
    env = os.environ.get(ENV_LIBRARY_DIR, "")
    for part in env.split(os.pathsep):
        if part.strip():
            dirs.append(Path(part.strip()).expanduser())
    dirs.append(Path(__file__).resolve().parent)
    installed = _installed_package_dir()
    if installed is not None:
        dirs.append(installed)
    seen: set[str] = set()
    out: list[Path] = []
    for d in dirs:
        key = str(d)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def _find_library(platform: str) -> Path | None:
    name = LIBRARY_NAMES[platform]
    for d in library_dir_candidates():
        p = d / name
        if p.is_file():
            return p
    return None


def _c_string(lib: ctypes.CDLL, symbol: str) -> str | None:
    try:
        fn = getattr(lib, symbol)
    except AttributeError:
        return None
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    value = fn()
    return value.decode() if value is not None else None


def _installed_ffi_api_version() -> tuple[int, int] | None:
    """The XLA FFI C API version of the installed jaxlib, read from its headers (None when unknown)."""
    try:
        import jax.ffi

        text = (Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h").read_text()
    except Exception:  # noqa: BLE001 - never raise; the reason is recorded
        return None
    major = re.search(r"#define\s+XLA_FFI_API_MAJOR\s+(\d+)", text)
    minor = re.search(r"#define\s+XLA_FFI_API_MINOR\s+(\d+)", text)
    if not (major and minor):
        return None
    return int(major.group(1)), int(minor.group(1))


def _gpu_backend_present() -> bool:
    try:
        import jax

        return len(jax.devices("gpu")) > 0
    except Exception:  # noqa: BLE001 - never raise; the reason is recorded
        return False


def _load(platform: str) -> None:
    st = _state[platform]
    if st.loaded:
        return
    st.loaded = True
    if platform == "cuda" and not _gpu_backend_present():
        st.reason = "no CUDA GPU backend in this JAX process (jax.devices('gpu') is empty or unavailable)"
        return
    path = _find_library(platform)
    if path is None:
        searched = ", ".join(str(d) for d in library_dir_candidates())
        st.reason = f"{LIBRARY_NAMES[platform]} was not found (searched: {searched}); {_BUILD_HINT}"
        return
    st.path = str(path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        st.reason = f"{path} failed to load: {e}; rebuild it against this environment ({_BUILD_HINT})"
        return
    st.version = _c_string(lib, "msa_ops_library_version")
    st.archs = _c_string(lib, "msa_ops_library_archs")
    st.ffi_api_version = _c_string(lib, "msa_ops_library_ffi_api_version")
    installed = _installed_ffi_api_version()
    if st.ffi_api_version and installed is not None:
        try:
            built = tuple(int(x) for x in st.ffi_api_version.split("."))
        except ValueError:
            built = None
        # Handlers load forward only: a library built against a newer FFI API (or another major) is refused.
        if built is not None and (built[0] != installed[0] or built[1] > installed[1]):
            st.reason = (
                f"{path} was built against XLA FFI API {st.ffi_api_version}, but the installed jaxlib provides "
                f"{installed[0]}.{installed[1]}; rebuild it against this jaxlib ({_BUILD_HINT})"
            )
            return
    # A library may serve a subset of TARGETS (the CUDA library grows op by op; a stale build lacks new
    # ones): register what it exports and record the rest. Callers check registered_targets() per target.
    st.missing = [t for t in TARGETS if not hasattr(lib, t)]
    try:
        import jax.ffi

        for name in TARGETS:
            if name in st.missing:
                continue
            jax.ffi.register_ffi_target(
                name, jax.ffi.pycapsule(getattr(lib, name)), platform=_XLA_PLATFORM[platform]
            )
            st.registered.append(name)
    except Exception as e:  # noqa: BLE001 - registration failure (wrong jaxlib, platform not linked in, ...)
        st.reason = f"registering the FFI targets of {path} failed: {type(e).__name__}: {e}"
        st.handle = lib
        return
    st.handle = lib
    if not st.registered:
        st.reason = f"{path} exports none of the msa_ops FFI targets; it is stale or not ours: {_BUILD_HINT}"
        return
    st.reason = None


def available(platform: str) -> bool:
    """True when the native library of ``platform`` ('cpu' or 'cuda') is loaded and its FFI targets are
    registered with JAX (which targets: ``registered_targets``). Loads it on the first call; never raises."""
    p = _normalize(platform)
    if p not in _state:
        return False
    with _lock:
        try:
            _load(p)
        except Exception as e:  # noqa: BLE001 - pragma: no cover - defensive
            _state[p].reason = f"loading failed: {type(e).__name__}: {e}"
        st = _state[p]
        return st.reason is None and bool(st.registered)


def missing_reason(platform: str, target: str | None = None) -> str:
    """Why ``available(platform)`` is False (or, given ``target``, why that target is not registered), with
    how to fix it; '' when nothing is missing."""
    p = _normalize(platform)
    if p not in _state:
        return f"no native library exists for platform {platform!r} (only 'cpu' and 'cuda')"
    if available(p):
        st = _state[p]
        if target is not None and target not in st.registered:
            return (f"{LIBRARY_NAMES[p]} ({st.path}) does not provide the FFI target {target!r} (version "
                    f"{st.version}); rebuild it from this source tree: {_BUILD_HINT}")
        return ""
    return _state[p].reason or "unknown reason"


def registered_targets(platform: str) -> list[str]:
    """FFI target names registered with JAX for ``platform`` (loads the library on first call)."""
    p = _normalize(platform)
    if p not in _state:
        return []
    available(p)
    return list(_state[p].registered)


def launch_counts() -> dict[str, int] | None:
    """How many times the CUDA library has launched each of its attention kernels in this process, by kind
    (``mma``, ``sm90_ws``, ``msa_decode``, ...; kernels/cuda/attention.cuh's LaunchKind), or None when the CUDA
    library is not loaded or predates the count. A launch counts when its FFI handler issues it, so a call
    captured in a CUDA graph counts once, when it is recorded. Tests compare two readings around a freshly
    compiled call to see which kernel served it."""
    if not available("cuda"):
        return None
    lib = _state["cuda"].handle
    names = _c_string(lib, "msa_ops_cuda_launch_names")
    if names is None or not hasattr(lib, "msa_ops_cuda_launch_counts"):
        return None
    kinds = names.split(",")
    buf = (ctypes.c_ulonglong * len(kinds))()
    fn = lib.msa_ops_cuda_launch_counts
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int]
    fn(buf, len(kinds))
    return {k: int(buf[i]) for i, k in enumerate(kinds)}


def _peek(path: Path) -> tuple[str | None, str | None]:
    """(version, archs) of a library that is not registered here (e.g. the CUDA library on a machine with no
    GPU): its string functions touch no device. (None, None) when it cannot be opened."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None, None
    return _c_string(lib, "msa_ops_library_version"), _c_string(lib, "msa_ops_library_archs")


def info() -> dict:
    """Library paths, versions, compiled architectures and registered targets per platform."""
    out: dict = {"library_dir_candidates": [str(d) for d in library_dir_candidates()], "platforms": {}}
    for p in LIBRARY_NAMES:
        ok = available(p)
        st = _state[p]
        found = _find_library(p)
        version, archs = st.version, st.archs
        if archs is None and found is not None:
            version, archs = _peek(found)
        out["platforms"][p] = {
            "available": ok,
            "library": st.path or (str(found) if found else None),
            "version": version,
            "archs": archs,
            "ffi_api_version": st.ffi_api_version,
            "registered_targets": list(st.registered),
            "missing_targets": list(st.missing),
            "reason": st.reason,
        }
    return out
