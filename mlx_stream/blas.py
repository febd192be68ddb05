"""Use an optimized BLAS under MLX's CPU backend on Linux, when one is installed.

The ``mlx[cpu]`` wheel links a vendored reference BLAS whose symbols ``libmlx.so``
resolves in the global scope, so an OpenBLAS loaded with ``RTLD_GLOBAL`` before
``mlx.core`` is first imported serves MLX instead (after that it is too late). Why:
docs/development.md ("OpenBLAS under MLX").

:func:`preload` does that once, never raising: a no-op when ``MLX_STREAM_BLAS=off``,
off Linux (macOS uses Accelerate), when MLX is already imported, or when no OpenBLAS is
found (Debian/Ubuntu: ``apt-get install libopenblas0-pthread``).
``MLX_STREAM_BLAS=/path/to/libopenblas.so.0`` picks a library; threads follow
``OPENBLAS_NUM_THREADS``. This module imports nothing from MLX.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from dataclasses import dataclass

ENV = "MLX_STREAM_BLAS"
OFF_VALUES = ("off", "0", "false", "no", "none")
# Symbols an OpenBLAS exports unprefixed; MLX needs the first, LAPACK calls the second.
REQUIRED_SYMBOLS = ("cblas_sgemm", "sgemm_")


def _candidates() -> list[str]:
    """Known OpenBLAS paths, most specific first (Debian/Ubuntu, Fedora, Arch, conda)."""
    arch = f"{platform.machine()}-linux-gnu"
    names = []
    for flavour in ("openblas-pthread", "openblas-openmp", "openblas-serial"):
        names.append(f"/usr/lib/{arch}/{flavour}/libopenblas.so.0")
    names += [
        f"/usr/lib/{arch}/libopenblas.so.0",
        "/usr/lib64/libopenblasp.so.0",
        "/usr/lib64/libopenblas.so.0",
        "/usr/lib/libopenblas.so.0",
        "/usr/local/lib/libopenblas.so.0",
        os.path.join(sys.prefix, "lib", "libopenblas.so.0"),
    ]
    return names


@dataclass(frozen=True)
class BlasStatus:
    """What :func:`preload` did.

    Attributes:
        state: ``"loaded"``, ``"off"`` (disabled by ``MLX_STREAM_BLAS``),
            ``"not-found"``, ``"not-linux"``, ``"late"`` (MLX was imported first) or
            ``"failed"`` (a library was found but could not be loaded).
        path: The library loaded (or the one that failed), else ``None``.
        detail: One line for people: why, or what was loaded.
    """

    state: str
    path: str | None
    detail: str

    @property
    def loaded(self) -> bool:
        """Whether an optimized BLAS now serves MLX."""
        return self.state == "loaded"


_status: BlasStatus | None = None
_loaded: tuple[str, ctypes.CDLL] | None = None  # the path and the library, kept referenced


def find_openblas() -> str | None:
    """The path of an installed OpenBLAS shared library, or ``None``.

    Known install paths first; then the linker cache (``ldconfig -p``) through
    :func:`ctypes.util.find_library`.
    """
    for path in _candidates():
        if os.path.isfile(path):
            return os.path.realpath(path)
    import ctypes.util  # runs ldconfig: only when no known path matched

    name = ctypes.util.find_library("openblas")
    return name or None


def _load(path: str) -> BlasStatus:
    global _loaded
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        return BlasStatus("failed", path, f"cannot load {path}: {e}")
    missing = [s for s in REQUIRED_SYMBOLS if not hasattr(lib, s)]
    if missing:
        return BlasStatus("failed", path, f"{path} lacks {', '.join(missing)}")
    _loaded = (path, lib)
    threads = lib.openblas_get_num_threads() if hasattr(lib, "openblas_get_num_threads") else None
    extra = f", {threads} threads" if threads else ""
    return BlasStatus("loaded", path, f"OpenBLAS {path}{extra}")


def preload(force: bool = False) -> BlasStatus:
    """Load an optimized BLAS for MLX's CPU backend if one is installed.

    Call it before the first ``import mlx.core``; later calls return the first
    result. Never raises.

    Args:
        force: Try again even if an earlier call already decided. Default: ``False``.

    Returns:
        A :class:`BlasStatus` saying what happened.
    """
    global _status
    if _status is not None and not force:
        return _status
    setting = os.environ.get(ENV, "auto").strip()
    _status = _decide(setting)
    if _status.state in ("failed", "not-found") and os.sep in setting:
        # a library asked for by path: say why it is not used (one line, never raise)
        sys.stderr.write(f"mlx-stream: {ENV}: {_status.detail}; using MLX's own BLAS\n")
    return _status


def _decide(setting: str) -> BlasStatus:
    if _loaded is not None:
        return BlasStatus("loaded", _loaded[0], f"OpenBLAS {_loaded[0]} (loaded before)")
    if setting.lower() in OFF_VALUES:
        return BlasStatus("off", None, f"disabled by {ENV}={setting}")
    if not sys.platform.startswith("linux"):
        return BlasStatus("not-linux", None, "not needed: MLX uses the platform BLAS")
    path = find_openblas() if setting.lower() == "auto" else setting
    if path is None:
        hint = "Debian/Ubuntu: apt-get install libopenblas0-pthread"
        return BlasStatus("not-found", None, f"no OpenBLAS found ({hint})")
    if os.sep in path and not os.path.exists(path):
        return BlasStatus("not-found", None, f"{ENV}={path} does not exist")
    if "mlx.core" in sys.modules:
        detail = "too late: mlx.core was imported before mlx_stream"
        return BlasStatus("late", path, detail)
    return _load(path)


def loaded_openblas() -> str | None:
    """The path of the OpenBLAS :func:`preload` loaded into this process, or ``None``."""
    return _loaded[0] if _loaded is not None else None


def status() -> BlasStatus | None:
    """The result of :func:`preload`, or ``None`` if it was never called."""
    return _status


def _mapped_file(address: int) -> str | None:
    """The file mapped at ``address`` in this process (``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                start, stop = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < stop and len(fields) >= 6:
                    return fields[5]
    except OSError:
        return None
    return None


def active_blas() -> str | None:
    """The library that serves MLX's ``cblas_sgemm`` in this process.

    A library loaded with ``RTLD_GLOBAL`` wins, else MLX's own vendored one. ``None``
    off Linux or when MLX is not loaded yet.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        address = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:
        address = None
    if address:
        return _mapped_file(address)
    return next((p for p in loaded_libraries() if "libblas" in os.path.basename(p)), None)


def loaded_libraries(keyword: str = "blas") -> list[str]:
    """Mapped shared libraries whose file name contains ``keyword`` (case-insensitive)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if keyword.lower() in os.path.basename(p).lower())
