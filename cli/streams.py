"""Standard streams and output files: JSON lines, tables, lenient stdin, and files
written atomically (a reader never sees half of one)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer


def json_line(data: Any) -> str:
    """``data`` as one JSON line in which NaN and infinities are ``null`` (JSON has
    no such numbers, and a reader must never mistake one for a figure)."""
    import json
    import math

    def finite(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        return value

    return json.dumps(finite(data), allow_nan=False)


def lenient_stdin():
    """Standard input as text where undecodable bytes become U+FFFD, not a crash."""
    import io

    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # already text (a test runner's stand-in)
        return sys.stdin
    return io.TextIOWrapper(buffer, encoding="utf-8", errors="replace")


def is_interactive(stream=None) -> bool:
    """Whether ``stream`` (default stdin) is a terminal."""
    stream = stream or sys.stdin
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def print_table(table: Any) -> None:
    """Print a rich table on stdout; off a terminal (a pipe, a file) as wide as its
    rows and without trailing blanks, so no name is cut to ``smollm2-135...`` nor a
    row wrapped."""
    from rich.console import Console

    console = Console()
    if console.is_terminal:
        console.print(table)
        return
    wide = Console(width=10_000)
    with wide.capture() as capture:
        wide.print(table)
    typer.echo("\n".join(line.rstrip() for line in capture.get().splitlines()))


def stderr_console():
    """A rich console on stderr (progress bars, tables) that never pollutes stdout."""
    from rich.console import Console

    return Console(stderr=True)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success move it over ``path``.

    The temporary name keeps the suffix of ``path`` (some writers pick the format
    from it) and carries this process's pid, so a later run removes it if this one is
    killed. On any error the temporary file is removed and ``path`` is untouched, so
    readers never see a half-written file. The file gets the mode the umask gives.
    """
    from mlx_stream import files

    path = Path(path)
    files.remove_stale(path)  # what a killed run left beside it
    fd, tmp = tempfile.mkstemp(prefix=files.temp_prefix(path), suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, files.file_mode())  # mkstemp makes it private; follow the umask
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp_path.unlink()
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file + ``os.replace``)."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_csv(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` (dicts with the same keys) as CSV to ``path`` atomically."""
    import csv
    import io

    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())
