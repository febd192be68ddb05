"""The package's layers import downwards only, and the top-level API stays lazy.

Every module under ``mlx_stream/`` is parsed with ``ast`` (imports inside functions
count: a lazy import still runs back up): the engine never imports the CLI, typer or
rich; ``cache/`` nothing above it; ``models/`` nothing from generation, serving or
evaluation; ``generate/`` nothing from serving or evaluation; ``eval/`` nothing from
serving; the base modules nothing from the package's folders.
"""

import ast
import subprocess
import sys

import pytest

import mlx_stream
from tests.conftest import REPO

PACKAGE = REPO / "mlx_stream"
FOLDERS = ("cache", "models", "generate", "serve", "eval")
BASE = ("errors", "files", "defaults", "blas")


def module_name(path, root=REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path, root=REPO) -> set[str]:
    """Every module ``path`` imports: ``from a import b`` gives ``a`` and ``a.b`` (``b``
    may be a submodule); relative imports are resolved against the module's package."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


MODULES = {module_name(p): imported(p) for p in sorted(PACKAGE.rglob("*.py"))}


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def offenders(prefix: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{module} imports {target}"
        for module, targets in MODULES.items()
        if under(module, prefix)
        for target in sorted(targets)
        if under(target, *forbidden)
    ]


def test_the_walk_sees_every_folder_and_lazy_imports():
    # The checks below pass vacuously if the walk finds nothing: pin a few known edges.
    for folder in FOLDERS:
        assert f"mlx_stream.{folder}" in MODULES
    assert "mlx_stream.cache.ring" in MODULES["mlx_stream.cache.sink"]
    assert "mlx_stream.models.gguf" in MODULES["mlx_stream.models.loader"]  # inside a function
    assert "mlx_stream.generate.batch" in MODULES["mlx_stream.serve.engine"]  # inside a method


def test_relative_imports_are_resolved(tmp_path):
    pkg = tmp_path / "mlx_stream" / "cache"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("from ..serve import engine\nfrom . import ring\n")
    found = imported(pkg / "x.py", tmp_path)
    assert {"mlx_stream.serve.engine", "mlx_stream.cache.ring"} <= found


def test_the_engine_never_imports_the_cli_typer_or_rich():
    assert offenders("mlx_stream", ("cli", "typer", "rich")) == []


@pytest.mark.parametrize(
    "folder, forbidden",
    [
        ("cache", ("serve", "eval", "generate", "models")),
        ("models", ("serve", "eval", "generate")),
        ("generate", ("serve", "eval")),
        ("eval", ("serve",)),
        ("recall", ("serve", "eval", "generate", "models")),
    ],
)
def test_no_import_runs_up_a_layer(folder, forbidden):
    prefixes = tuple(f"mlx_stream.{f}" for f in forbidden)
    assert offenders(f"mlx_stream.{folder}", prefixes) == []


@pytest.mark.parametrize("module", BASE)
def test_base_modules_import_none_of_the_folders(module):
    prefixes = tuple(f"mlx_stream.{f}" for f in (*FOLDERS, "checkpoint", "distributed"))
    assert offenders(f"mlx_stream.{module}", prefixes) == []


def test_import_mlx_stream_loads_neither_mlx_nor_mlx_lm():
    code = (
        "import sys, mlx_stream, mlx_stream.cache, mlx_stream.cache.estimate; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert out.stdout.strip() == "[]"


def test_each_public_name_resolves_to_its_engine_object():
    from mlx_stream.cache.sink import SinkCache, make_sink_cache
    from mlx_stream.cache.spec import CacheSpec
    from mlx_stream.generate.decode import stream_generate
    from mlx_stream.generate.session import ChatSession
    from mlx_stream.models.loader import load
    from mlx_stream.recall.spec import RecallSpec

    expected = {
        "load": load,
        "make_sink_cache": make_sink_cache,
        "SinkCache": SinkCache,
        "CacheSpec": CacheSpec,
        "stream_generate": stream_generate,
        "ChatSession": ChatSession,
        "RecallSpec": RecallSpec,
    }
    assert set(mlx_stream.__all__) == {"__version__", *expected}
    for name, value in expected.items():
        assert getattr(mlx_stream, name) is value
        assert name in dir(mlx_stream)
    with pytest.raises(AttributeError, match="no_such_name"):
        mlx_stream.no_such_name  # noqa: B018


def test_the_cache_package_re_exports_the_sink_cache_api():
    import mlx_stream.cache
    import mlx_stream.cache.sink as sink

    for name in mlx_stream.cache.__all__:
        assert getattr(mlx_stream.cache, name) is getattr(sink, name)
    assert set(mlx_stream.cache.__all__) == {
        "SinkCache",
        "make_sink_cache",
        "save_cache",
        "load_cache",
        "max_call_tokens",
        "validate_sizes",
        "CacheSpec",
    }


@pytest.mark.parametrize("part", ["admission", "store", "matching", "refusals"])
def test_the_serve_engines_parts_never_import_the_engine(part):
    """The engine composes its parts; none of them runs back up to it (no cycle)."""
    assert f"mlx_stream.serve.{part}" in MODULES
    assert offenders(f"mlx_stream.serve.{part}", ("mlx_stream.serve.engine",)) == []


def test_the_engine_re_exports_what_the_http_side_imports():
    from mlx_stream.serve import engine, matching, refusals

    assert engine.Entry is matching.Entry and engine.split_messages is matching.split_messages
    for name in ("Busy", "BadRequest", "TooLarge", "Unsaved"):
        assert getattr(engine, name) is getattr(refusals, name)
