"""One-line errors and exit codes: every command's failures end as ``Error: ...`` on
stderr and an exit code (2 bad usage or input, 1 runtime, 130 interrupted, 141 a
closed pipe)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import typer

F = TypeVar("F", bound=Callable[..., Any])

EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for `cmd | head`
DEBUG_ENV = "MLX_STREAM_DEBUG"


def _user_error_class() -> type[Exception]:
    from mlx_stream.errors import UserError

    return UserError


def fail(message: str) -> NoReturn:
    """Raise the engine's one-line user error (exit 2) with ``message``."""
    raise _user_error_class()(message)


def error_line(message: str) -> None:
    """Print ``Error: message`` as exactly one line on stderr."""
    text = " ".join(str(message).split()) or "unknown error"
    typer.echo(f"Error: {text}", err=True)


def exit_code_for(exc: BaseException) -> int:
    """The exit code of an exception: 2 for bad usage or input, 1 for runtime failures.

    The engine's ``UserError`` carries its own ``exit_code`` (2, or 1 for its runtime
    subclass); undecodable input is bad input; anything else is a runtime failure.
    """
    code = getattr(exc, "exit_code", None)
    if isinstance(code, int):
        return code
    return EXIT_USAGE if isinstance(exc, UnicodeDecodeError) else EXIT_RUNTIME


def describe(exc: BaseException) -> str:
    """A one-line description of ``exc`` for the user."""
    if isinstance(exc, UnicodeDecodeError):
        return f"input is not UTF-8 text ({exc.reason} at byte {exc.start})"
    if isinstance(exc, MemoryError):
        return "out of memory"
    text = str(exc)
    if isinstance(exc, _user_error_class()) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def handle_errors(func: F) -> F:
    """Decorate a command so failures end as one line on stderr and an exit code.

    ``typer.Exit``/``Abort`` and click usage errors pass through untouched. Set
    ``MLX_STREAM_DEBUG=1`` to see the traceback of an unexpected error.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            result = func(*args, **kwargs)
            sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
            return result
        except BrokenPipeError:
            silence_stdout()
            raise typer.Exit(EXIT_BROKEN_PIPE) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except KeyboardInterrupt:
            typer.echo("", err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except Exception as exc:  # noqa: BLE001 - this is the one place that catches all
            import click

            if isinstance(exc, click.ClickException):
                raise
            if os.environ.get(DEBUG_ENV):
                raise
            error_line(describe(exc))
            raise typer.Exit(exit_code_for(exc)) from None

    return wrapper  # type: ignore[return-value]


def silence_stdout() -> None:
    """Point stdout at /dev/null: the reader of a pipe went away (``| head``), and
    Python's final flush must not print a traceback about it."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
