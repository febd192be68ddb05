"""Help text that reads as sentences (typer-only: ``mlx-stream --help`` stays instant)."""

from __future__ import annotations

import inspect
from typing import Any

import typer


def reflow(text: str | None) -> str | None:
    """A docstring as help text: each paragraph's lines joined into one (the help
    wraps them to the terminal, so none breaks mid-sentence); paragraphs with indented
    or bulleted lines, and ``\\b`` blocks, stay as written."""
    if not text:
        return text
    paragraphs = []
    for para in inspect.cleandoc(text).split("\n\n"):
        lines = para.split("\n")
        kept = para.startswith("\b") or any(line.startswith((" ", "- ", "* ")) for line in lines)
        paragraphs.append(para if kept else " ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs)


def tidy_help(app: typer.Typer) -> None:
    """Help that reads as sentences: every command's docstring reflowed (:func:`reflow`)
    and flags shown without a type (typer 0.29 prints ``<bool>`` beside ``--json``)."""
    from typer.core import TyperOption

    for info in app.registered_commands:
        if info.callback is not None:
            info.callback.__doc__ = reflow(info.callback.__doc__)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            tidy_help(group.typer_instance)
    shown = TyperOption.display_type_rich
    if not getattr(shown, "tidy", False) and callable(shown):

        def display_type_rich(self: Any, ctx: Any) -> str | None:
            return None if self.is_flag else shown(self, ctx)

        display_type_rich.tidy = True  # type: ignore[attr-defined]
        TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]
