"""Option groups: how a command takes the options several commands share.

A group (the ones in :mod:`cli.options`) is a frozen dataclass whose fields are the
options (``Annotated`` aliases, field name = parameter name). A command takes a group
as one parameter (``cache: opt.CacheOptions``); :func:`grouped` splices the group's
options into the signature Typer reads (``__signature__``), under the group's help
panel, and hands the command the built group. ``Annotated[opt.CacheOptions,
Only("sinks")]`` takes some of its options (the others keep their defaults); a
subclass that redeclares a field gives a command its own wording of that option
(``serve``'s ``--window``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from copy import copy
from typing import Annotated, Any, ClassVar

from typer.models import OptionInfo

F = typing.TypeVar("F", bound=Callable[..., Any])


class Only:
    """``Annotated`` metadata of a group parameter: the command takes only these options
    of the group; the group's other fields keep their defaults."""

    def __init__(self, *names: str):
        self.names = names


@dataclasses.dataclass(frozen=True)
class OptionGroup:
    """Base of the groups: ``panel`` is the help panel of its options (``None``: the
    command's own "Options" panel)."""

    panel: ClassVar[str | None] = None

    @classmethod
    def options(cls) -> dict[str, Any]:
        """``{name: Annotated[type, typer.Option]}`` of the fields, each in ``panel``."""
        hints = typing.get_type_hints(cls, include_extras=True)
        return {f.name: _in_panel(hints[f.name], cls.panel) for f in dataclasses.fields(cls)}


def _in_panel(annotation: Any, panel: str | None) -> Any:
    """``annotation`` with its ``typer.Option`` copied into the help panel ``panel``."""
    if panel is None:
        return annotation
    base, *metadata = typing.get_args(annotation)
    marked = []
    for item in metadata:
        if isinstance(item, OptionInfo):
            item = copy(item)
            item.rich_help_panel = panel
        marked.append(item)
    return Annotated[(base, *marked)]


def group_of(annotation: Any) -> tuple[type[OptionGroup], tuple[str, ...] | None] | None:
    """``(group, names or None for all)`` when ``annotation`` names a group, else None."""
    only = None
    if typing.get_origin(annotation) is Annotated:
        annotation, *metadata = typing.get_args(annotation)
        only = next((m.names for m in metadata if isinstance(m, Only)), None)
    if isinstance(annotation, type) and issubclass(annotation, OptionGroup):
        return annotation, only
    return None


def grouped(func: F) -> F:
    """Decorate a command whose parameters include groups: Typer sees each group's
    options in its place (``__signature__``), the command gets the built groups.

    Raises:
        TypeError: an option name taken twice (by the command and a group, or two
            groups), or an ``Only`` name the group does not have.
    """
    hints = typing.get_type_hints(func, include_extras=True)
    params: list[inspect.Parameter] = []
    groups: dict[str, tuple[type[OptionGroup], list[str]]] = {}
    for p in inspect.signature(func).parameters.values():
        found = group_of(hints.get(p.name))
        if found is None:
            params.append(p.replace(annotation=hints.get(p.name, p.annotation)))
            continue
        group, only = found
        options = group.options()
        if only is not None and set(only) - set(options):
            raise TypeError(f"{group.__name__} has no option {sorted(set(only) - set(options))}")
        names = [n for n in options if only is None or n in only]
        groups[p.name] = (group, names)
        defaults = {f.name: f.default for f in dataclasses.fields(group)}
        params += [inspect.Parameter(n, p.KEYWORD_ONLY, default=defaults[n],
                                     annotation=options[n]) for n in names]  # fmt: skip
    taken = [p.name for p in params]
    if len(set(taken)) != len(taken):
        twice = sorted({n for n in taken if taken.count(n) > 1})
        raise TypeError(f"{func.__name__}: options declared twice: {twice}")
    params = [p.replace(kind=p.KEYWORD_ONLY) for p in params]

    @functools.wraps(func)
    def command(**kwargs: Any) -> Any:
        for name, (group, names) in groups.items():
            kwargs[name] = group(**{n: kwargs.pop(n) for n in names})
        return func(**kwargs)

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    return typing.cast(F, command)
