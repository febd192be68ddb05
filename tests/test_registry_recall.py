"""Recall defaults in the registry (``recall: {blocks: 8, bits: 8}``): parsed and checked
with one line per bad field, used by ``--recall`` when its options are not on the
command line (a flag always wins), and shown by ``models info``."""

from __future__ import annotations

from typing import Annotated

import pytest
import typer
import yaml
from typer.testing import CliRunner

from cli import options as opt
from cli.main import app as main_app
from mlx_stream.errors import UserError
from mlx_stream.models import registry
from tests.support.cli import assert_one_line_error

runner = CliRunner()


def write_user(data) -> None:
    path = registry.user_registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))


def entry(recall) -> dict:
    return {"sources": [{"hf": "org/tiny-recall"}], "recall": recall}


def test_recall_defaults_are_parsed():
    write_user({"models": {"r": entry({"blocks": 3, "bits": 8, "ram_mb": 0})}})
    spec = registry.load_registry().get("r")
    assert spec.recall == {"blocks": 3, "bits": 8, "ram_mb": 0}
    assert registry.load_registry().get("smollm2-135m-instruct").recall is None


@pytest.mark.parametrize(
    "recall, field",
    [
        ({"blocks": 0}, "'recall.blocks'"),
        ({"blocks": "8"}, "'recall.blocks'"),
        ({"bits": 3}, "'recall.bits'"),
        ({"ram_mb": -1}, "'recall.ram_mb'"),
        ({"ram_mb": True}, "'recall.ram_mb'"),
        ({"selector": "exact"}, "'recall.selector'"),
        ("eight blocks", "field 'recall'"),
    ],
)
def test_bad_recall_defaults_are_one_line(recall, field):
    write_user({"models": {"bad": entry(recall)}})
    with pytest.raises(UserError) as e:
        registry.load_registry()
    assert "model 'bad'" in str(e.value) and field in str(e.value)
    assert "\n" not in str(e.value)


def probe_app() -> typer.Typer:
    """A command with the real ``--model`` and ``--recall*`` options that prints the
    RecallSpec ``cli.common.recall_spec`` builds."""
    from cli.common import handle_errors, recall_spec

    app = typer.Typer()

    @app.command()
    @handle_errors
    def probe(
        model: opt.Model = None,
        recall: opt.Recall = False,
        recall_blocks: opt.RecallBlocks = opt.DEFAULT_RECALL_BLOCKS,
        recall_bits: opt.RecallBits = None,
        recall_ram: opt.RecallRam = opt.DEFAULT_RECALL_RAM_MB,
        recall_dir: opt.RecallDir = None,
        extra: Annotated[int, typer.Option()] = 0,
    ) -> None:
        s = recall_spec(recall, recall_blocks, recall_bits, recall_ram, recall_dir)
        typer.echo("off" if s is None else f"{s.blocks} {s.bits} {s.ram_bytes}")

    return app


@pytest.mark.parametrize(
    "args, expected",
    [
        (["-m", "r", "--recall"], "3 8 0"),  # the registry's
        (["-m", "r", "--recall", "--recall-blocks", "8"], "8 8 0"),  # a flag equal to the
        (["-m", "r", "--recall", "--recall-bits", "4", "--recall-ram", "5"], "3 4 5000000"),
        (["-m", "r"], "off"),  # no --recall: none
        (["-m", "org/tiny-recall", "--recall"], "3 8 0"),  # its catalogue entry's
        (["-m", "smollm2-135m-instruct", "--recall"], "8 None 1024000000"),  # package defaults
        (["--recall"], "8 None 1024000000"),  # the default model has none
    ],
)
def test_flags_override_the_registry_defaults(args, expected, tmp_path):
    write_user({"models": {"r": entry({"blocks": 3, "bits": 8, "ram_mb": 0})}})
    result = runner.invoke(probe_app(), args)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == expected


def test_a_folder_takes_no_registry_defaults(tiny_model_dir):
    write_user({"models": {"r": entry({"blocks": 3})}})
    result = runner.invoke(probe_app(), ["-m", str(tiny_model_dir), "--recall"])
    assert result.stdout.strip() == "8 None 1024000000"


def test_a_bad_registry_is_one_line_for_a_recall_command(tiny_model_dir):
    write_user({"models": {"r": entry({"bits": 5})}})
    result = runner.invoke(main_app, ["models", "info", "r"])
    assert_one_line_error(result, 2, "recall.bits")


def test_models_info_shows_the_recall_defaults():
    write_user({"models": {"r": entry({"blocks": 3, "bits": 8})}})
    result = runner.invoke(main_app, ["models", "info", "r"])
    assert result.exit_code == 0, result.output
    assert "recall:      defaults --recall-blocks 3, --recall-bits 8 (flags override)" in (
        result.stdout
    )


def test_models_info_prices_the_store_at_the_registry_defaults(tiny_model_dir):
    import json

    from cli.models import _recall_line
    from mlx_stream.cache.estimate import config_layout, human, recall_bytes

    config = json.loads((tiny_model_dir / "config.json").read_text())
    layout = config_layout(config, 4)
    line = _recall_line(config, tiny_model_dir, "float32", 4, {"blocks": 3, "bits": 8})
    mine, plain = recall_bytes(layout, 4, 3, bits=8), recall_bytes(layout, 4, 3)
    assert f"region {human(mine['region_bytes'])} reserved (device, 3 blocks)" in line
    per_1k = human(mine["store_bytes_per_1k_tokens"])
    assert f"store uses {per_1k} per 1k evicted tokens (RAM, then disk)" in line
    assert "at --recall-bits 8" in line
    assert f"({human(plain['store_bytes_per_1k_tokens'])} per 1k in the model's dtype)" in line
    default = _recall_line(config, tiny_model_dir, "float32", 4)
    assert "(device, 8 blocks)" in default and "at --recall-bits 8" in default
