"""Root of the ``mlx-stream`` command: registers one module per command.

Only typer is imported here; every command imports the engine (mlx, mlx-lm) inside
its body so ``mlx-stream --help`` stays instant.
"""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(
    name="mlx-stream",
    help=(
        "Run language models forever in fixed memory: attention sinks + a rolling "
        "window of recent tokens (StreamingLLM) on MLX.\n\n"
        "Examples:\n\n"
        "  mlx-stream chat\n\n"
        "  mlx-stream stream-run book.txt --window 1024\n\n"
        "  mlx-stream profile --tokens 2000 --compare\n\n"
        "  mlx-stream models list"
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        from mlx_stream import __version__

        typer.echo(f"mlx-stream {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """mlx-stream: a fixed-memory streaming runtime for MLX language models."""


from . import chat, profile, serve, stream_run  # noqa: E402 - typer-only modules

app.command("chat")(chat.chat)
app.command("serve")(serve.serve)
app.command("stream-run")(stream_run.stream_run)
app.command("profile")(profile.profile)


from .models import app as models_app  # noqa: E402 - typer-only module

app.add_typer(models_app, name="models")

from .eval import app as eval_app  # noqa: E402 - typer-only module

app.add_typer(eval_app, name="eval")

from .doctor import doctor  # noqa: E402 - typer-only module

app.command("doctor")(doctor)

from .help import tidy_help  # noqa: E402 - typer-only module

tidy_help(app)  # docstrings reflowed to the terminal, flags without <bool>


def main() -> None:
    import mlx_stream  # noqa: F401 - before any command imports mlx: preloads OpenBLAS

    app()


if __name__ == "__main__":
    main()
