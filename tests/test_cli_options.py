"""Option groups (cli/groups.py): an option several commands share is declared once,
in its group, and no command's own signature declares it again."""

from __future__ import annotations

import inspect
import typing

import pytest
import typer
from typer.testing import CliRunner

from cli import options as opt
from cli.groups import Only, group_of, grouped
from cli.main import app
from cli.options import CacheOptions, ModelOptions, RecallOptions

runner = CliRunner()

# A command's own option under a flag a group also declares: another option, not the
# group's declared again.
ANOTHER_OPTION = {
    ("eval divergence", "--window"): "comma-separated windows, one policy each",
    ("eval divergence", "--sinks"): "comma-separated sinks, one policy each",
    ("eval divergence", "--kv-bits"): "comma-separated cache precisions",
    ("eval recall", "--window"): "comma-separated windows",
    ("eval recall", "--seed"): "the pass keys' seed, not the sampler's",
    ("eval recall", "--json"): "one JSON object per window and placement",
    ("models list", "--json"): "the models as an indented JSON list",
    ("doctor", "--json"): "the report as one JSON object",
}


def commands(t: typer.Typer = app, prefix: str = ""):
    """``(name, callback)`` of every command, subcommands named ``group command``."""
    for info in t.registered_commands:
        name = info.name or info.callback.__name__.replace("_", "-")
        yield f"{prefix}{name}", info.callback
    for group in t.registered_groups:
        yield from commands(group.typer_instance, f"{prefix}{group.name} ")


def own_names(callback) -> set[str]:
    """The parameters the command's own signature declares (its groups left out)."""
    func = inspect.unwrap(callback)
    hints = typing.get_type_hints(func, include_extras=True)
    return {n for n in inspect.signature(func).parameters if group_of(hints.get(n)) is None}


def click_params(name: str) -> dict:
    """``{parameter name: click parameter}`` of the command ``name``."""
    command = typer.main.get_command(app)
    for part in name.split():
        command = command.commands[part]
    return {p.name: p for p in command.params}


def test_no_command_declares_a_group_option_again():
    shared, own = {}, []
    for name, callback in commands():
        mine = own_names(callback)
        for pname, param in click_params(name).items():
            for flag in param.opts + param.secondary_opts:
                if pname in mine:
                    own.append((name, flag))
                else:
                    shared.setdefault(flag, name)
    assert shared, "no command takes a group"
    again = [(c, f) for c, f in own if f in shared and (c, f) not in ANOTHER_OPTION]
    assert not again, f"declared again outside their group: {again}"
    assert set(ANOTHER_OPTION) <= set(own), "a stale entry in ANOTHER_OPTION"


def test_help_shows_the_commands_own_options_first_then_the_groups_panels():
    out = runner.invoke(app, ["chat", "--help"], env={"COLUMNS": "200"}).stdout
    panels = ["─ Options ", "─ Model ", "─ KV cache ", "─ Sampling ", "─ Speculative decoding ",
              "─ Recall ", "─ Prefix store "]  # fmt: skip
    where = [out.index(p) for p in panels]
    assert where == sorted(where)
    assert where[0] < out.index("--keep-system") < where[1] < out.index("--model") < where[2]
    assert where[3] < out.index("--temp") < out.index("--seed") < where[4]


def probe_app() -> typer.Typer:
    """A command with groups that prints what it was handed."""
    probe = typer.Typer()

    @probe.command()
    @grouped
    def show(
        extra: typing.Annotated[int, typer.Option()] = 0,
        *,
        model: ModelOptions,
        cache: typing.Annotated[CacheOptions, Only("sinks", "window")],
    ) -> None:
        typer.echo(f"{extra} {model.model} {model.dtype} {cache.sinks} {cache.window} "
                   f"{cache.kv_bits}")  # fmt: skip

    return probe


def test_a_command_gets_its_groups_built():
    result = runner.invoke(probe_app(), ["-m", "tiny", "--sinks", "2", "--extra", "1"])
    assert result.exit_code == 0, result.output
    assert result.stdout.split() == ["1", "tiny", "auto", "2", "None", "None"]
    refused = runner.invoke(probe_app(), ["--kv-bits", "4"])  # not taken: no such option
    assert refused.exit_code == 2


def test_an_option_taken_twice_or_unknown_is_refused():
    def twice(sinks: opt.Sinks = None, *, cache: CacheOptions) -> None: ...

    def unknown(*, recall: typing.Annotated[RecallOptions, Only("recall_size")]) -> None: ...

    with pytest.raises(TypeError, match="sinks"):
        grouped(twice)
    with pytest.raises(TypeError, match="recall_size"):
        grouped(unknown)
