"""Files written so that nothing half-done is ever seen or left behind, and the user
cache they go under (:func:`home_dir`).

Temporary files and folders are made beside their target and named
``.<target>.<kind>-<pid>-...`` so that the next run can tell a leftover of a killed
process (its pid is gone) from the work of one still running, and remove it. New files
get the permissions the user's umask gives (``mkstemp`` alone makes them private).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

STALE_KINDS = ("partial", "old", "download", "rm")
ENV_HOME = "MLX_STREAM_HOME"


def home_dir(home: str | os.PathLike | None = None) -> Path:
    """The user cache: ``home`` if given, else ``$MLX_STREAM_HOME``, else the platform's
    user cache dir ``mlx-stream``."""
    if home is not None:
        return Path(home).expanduser()
    if os.environ.get(ENV_HOME):
        return Path(os.environ[ENV_HOME]).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("mlx-stream"))


def file_mode() -> int:
    """The mode a new file gets under the current umask (``0o666 & ~umask``)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def temp_prefix(target: Path, kind: str = "partial") -> str:
    """The name prefix of a temporary beside ``target``, carrying this process's pid."""
    return f".{target.name}.{kind}-{os.getpid()}-"


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(target: Path, kinds: tuple[str, ...] = STALE_KINDS) -> list[Path]:
    """Remove the temporaries a killed process left beside ``target``: files or folders
    ``.<name>.<kind>-<pid>-*`` whose process is gone (a ``SIGKILL`` skips cleanup).

    Returns:
        The paths removed.
    """
    removed = []
    if not target.parent.is_dir():
        return removed
    for kind in kinds:
        head = f".{target.name}.{kind}-"
        for path in target.parent.glob(f"{glob_escape(head)}*"):
            pid = path.name[len(head) :].split("-", 1)[0]
            if not pid.isdigit() or int(pid) == os.getpid() or alive(int(pid)):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def glob_escape(text: str) -> str:
    """``text`` with glob metacharacters escaped."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)
