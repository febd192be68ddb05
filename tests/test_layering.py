"""The package's layers import downwards only, the top-level API stays lazy, and no
module grows past MAX_LINES.

Every module under ``mlx_stream/`` is parsed with ``ast`` (imports inside functions
count: a lazy import still runs back up): the engine never imports the CLI, typer or
rich; ``cache/`` nothing above it; ``models/`` nothing from generation, serving or
evaluation; ``generate/`` nothing from serving or evaluation; ``eval/`` nothing from
serving; the base modules nothing from the package's folders; and no import circle
among the package's modules beyond the known ones (``KNOWN_CIRCLES``). No module of the
package, the CLI, the benchmarks or the tests reaches another object's private attribute
(``x._name``, as ruff's SLF001; ``SLF001_PENDING`` lists the files still to fix), and
only ``mlx_stream/mlxlm.py`` imports mlx-lm's private names.
"""

import ast
import functools
import re
import subprocess
import sys

import pytest

import mlx_stream
from tests.support.paths import REPO

PACKAGE = REPO / "mlx_stream"
FOLDERS = ("cache", "models", "generate", "serve", "eval")
BASE = ("errors", "files", "defaults", "blas", "mlxlm")


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
    assert "mlx_stream.cache.ring" in MODULES["mlx_stream.cache.layer"]
    assert "mlx_stream.models.gguf" in MODULES["mlx_stream.models.loader"]  # inside a function
    assert "mlx_stream.generate.batch" in MODULES["mlx_stream.serve.scheduler"]  # in a method


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
        ("cache", ("serve", "eval", "generate", "models", "recall")),
        ("models", ("serve", "eval", "generate", "prefix_store")),
        ("prefix_store", ("models", "generate", "serve", "eval", "recall")),
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


def test_mlxlm_imports_nothing_of_the_package():
    """mlx-lm's internals sit below everything: the module may import mlx and mlx-lm."""
    assert "mlx_lm.models.cache" in MODULES["mlx_stream.mlxlm"]  # lazy imports are seen
    assert [t for t in MODULES["mlx_stream.mlxlm"] if under(t, "mlx_stream")] == []


def test_import_mlx_stream_loads_neither_mlx_nor_mlx_lm():
    code = (
        "import sys, mlx_stream, mlx_stream.cache, mlx_stream.cache.estimate, mlx_stream.mlxlm; "
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


# ------------------------------------------------------------------ import circles

# The circles there are today, each the modules of one (a strongly connected part of
# the import graph, lazy imports included); cache and recall no longer reach each other
# (the extension seam, cache/extension.py). A circle not listed, or a module
# joining a listed one, fails; so does a listed one that is gone (remove it here).
KNOWN_CIRCLES: list[set[str]] = []


def import_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}`` (names that are not modules, such
    as a class in ``from a import B``, dropped)."""
    return {m: {t for t in targets if t in modules and t != m} for m, targets in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The import circles of ``graph``: its strongly connected parts of two or more
    modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part: set[str] = set()
                    while node not in part:
                        part.add(stack.pop())
                    if len(part) > 1:
                        found.append(part)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in stack:
                low[node] = min(low[node], index[child])
    return found


def describe(graph: dict[str, set[str]], part: set[str]) -> str:
    edges = sorted(f"{m} -> {t}" for m in part for t in graph[m] if t in part)
    return "; ".join(edges)


def test_circles_are_found_lazy_imports_included():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(map(sorted, circles(graph))) == [["a", "b", "c"], ["d", "e"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    # a lazy import inside a function is still an edge of the graph
    assert "mlx_stream.recall.tier" in import_graph(MODULES)["mlx_stream.recall.seam"]


def test_no_import_circle_but_the_known_ones():
    graph = import_graph(MODULES)
    found = circles(graph)
    new = [part for part in found if not any(part <= known for known in KNOWN_CIRCLES)]
    assert not new, "new import circles: " + " | ".join(describe(graph, p) for p in new)
    gone = [known for known in KNOWN_CIRCLES if not any(part & known for part in found)]
    assert not gone, f"no longer circles, remove them from KNOWN_CIRCLES: {gone}"


# ------------------------------------------------------------------ module size

MAX_LINES = 600
# The modules over MAX_LINES today, each to be split (then removed here). A module not
# listed that grows over it fails; so does a listed one that is no longer over it.
OVER_MAX_LINES: set[str] = set()


def module_lines() -> dict[str, int]:
    """Lines of every module in ``mlx_stream/`` and ``cli/``, by path from the repo."""
    paths = [*PACKAGE.rglob("*.py"), *(REPO / "cli").rglob("*.py")]
    return {p.relative_to(REPO).as_posix(): len(p.read_text().splitlines()) for p in paths}


def test_no_module_is_over_the_line_limit():
    lines = module_lines()
    assert "cli/serve.py" in lines and "mlx_stream/serve/engine.py" in lines
    over = {path: n for path, n in lines.items() if n > MAX_LINES and path not in OVER_MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them): {over}"


def test_the_modules_allowed_over_the_limit_are_still_over_it():
    lines = module_lines()
    done = sorted(p for p in OVER_MAX_LINES if lines.get(p, 0) <= MAX_LINES)
    assert not done, f"no longer over {MAX_LINES} lines, remove them from OVER_MAX_LINES: {done}"


# ------------------------------------------------------------------ private names

ROOTS = ("mlx_stream", "cli", "benchmarks", "tests")
# The files that still reach other objects' private attributes, each to be fixed (then
# removed here). A file not listed that does fails; so does a listed one that no longer
# does.
SLF001_PENDING: set[str] = set()
# Underscored names that are public API (as ruff's SLF001 has them): namedtuple's.
PUBLIC_NAMES = {"_asdict", "_replace", "_make", "_fields", "_field_defaults"}
NOQA = re.compile(r"#\s*noqa:[^#\n]*\bSLF001\b")


def is_private(node: ast.Attribute) -> bool:
    name = node.attr
    if not name.startswith("_") or name == "_" or name in PUBLIC_NAMES:
        return False
    if name.startswith("__") and name.endswith("__"):
        return False
    return not (isinstance(node.value, ast.Name) and node.value.id == "os" and name == "_exit")


def is_own(value: ast.expr, classes: list[str]) -> bool:
    """``self``, ``cls``, ``mcs``, ``super()`` or an enclosing class."""
    if isinstance(value, ast.Call):
        return isinstance(value.func, ast.Name) and value.func.id == "super"
    return isinstance(value, ast.Name) and value.id in ("self", "cls", "mcs", *classes)


class PrivateAccesses(ast.NodeVisitor):
    def __init__(self):
        self.classes: list[str] = []
        self.found: list[tuple[int, str]] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if is_private(node) and not is_own(node.value, self.classes):
            self.found.append((node.lineno, node.attr))
        self.generic_visit(node)


def private_accesses(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of each ``x._name`` in ``source`` where ``x`` is another object
    (not ``self``, ``cls``, ``super()`` or the enclosing class; dunders aside), except
    on a line marked ``# noqa: SLF001``."""
    visitor = PrivateAccesses()
    visitor.visit(ast.parse(source))
    lines = source.splitlines()
    return [(n, name) for n, name in visitor.found if not NOQA.search(lines[n - 1])]


@functools.cache
def sources() -> dict[str, str]:
    """Every Python file under ROOTS, by path from the repo."""
    paths = [p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))]
    return {p.relative_to(REPO).as_posix(): p.read_text() for p in paths}


@functools.cache
def files_with_private_accesses() -> dict[str, list[tuple[int, str]]]:
    found = {path: private_accesses(source) for path, source in sources().items()}
    return {path: hits for path, hits in found.items() if hits}


def test_the_private_access_check_finds_a_planted_one():
    code = (
        "import os\n"
        "class A:\n"
        "    def f(self, o):\n"
        "        self._a, super()._b, A._c, o.__len__, o._replace(), os._exit\n"
        "        return o._x, o.y._z\n"
        "\n"
        "w = A()._w  # noqa: SLF001 - planted\n"
    )
    assert private_accesses(code) == [(5, "_x"), (5, "_z")]
    assert "tests/test_layering.py" in sources() and "benchmarks/common.py" in sources()


def test_no_module_reaches_another_objects_private_attributes():
    """Tests and benchmarks use public seams or fixtures; a third-party private goes
    through mlx_stream/mlxlm.py (mlx-lm) or one ``# noqa: SLF001 - reason`` line."""
    found = files_with_private_accesses()
    new = {path: hits for path, hits in found.items() if path not in SLF001_PENDING}
    assert not new, f"private attributes of other objects: {new}"


def test_the_files_allowed_private_accesses_still_have_some():
    done = sorted(SLF001_PENDING - set(files_with_private_accesses()))
    assert not done, f"no private accesses left, remove them from SLF001_PENDING: {done}"


def test_only_mlxlm_imports_mlx_lms_private_names():
    found = [
        f"{path}: {node.module}.{alias.name}"
        for path, source in sources().items()
        if path != "mlx_stream/mlxlm.py"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and under(node.module or "", "mlx_lm")
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert found == [], "import them through mlx_stream/mlxlm.py"


# ------------------------------------------------------------------ private names across modules

# The package's modules that still import another module's private name, each to be
# fixed (then removed here).
PRIVATE_IMPORT_PENDING: set[str] = set()


def private_imports(path, root=REPO) -> list[str]:
    """Another package module's private names ``path`` uses: ``from mlx_stream.x import
    _y`` (relative imports resolved) and ``x._y`` where ``x`` names a package module it
    imported (dunders aside)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    modules: set[str] = set()  # local names bound to package modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not under(base, "mlx_stream"):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{base}.{alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if under(alias.name, "mlx_stream"):
                    modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_the_private_import_check_finds_planted_ones(tmp_path):
    pkg = tmp_path / "mlx_stream" / "recall"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text(
        "from mlx_stream.checkpoint import _raw, __version__\n"
        "from .select import _gqa, group_queries\n"
        "from mlx_stream.models.hub import local\n"
        "from os import _exit\n"
        "local._read_config(None), group_queries._cache, local.__name__\n"
    )
    assert sorted(private_imports(pkg / "x.py", tmp_path)) == [
        "group_queries._cache",
        "local._read_config",
        "mlx_stream.checkpoint._raw",
        "mlx_stream.recall.select._gqa",
    ]


def test_no_module_imports_another_modules_private_names():
    """A name used across modules is public: no ``_name`` crosses a module's edge."""
    found = {
        path.relative_to(REPO).as_posix(): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if (hits := private_imports(path))
    }
    new = {path: hits for path, hits in found.items() if path not in PRIVATE_IMPORT_PENDING}
    assert not new, f"private names imported across modules (make them public): {new}"
    done = sorted(PRIVATE_IMPORT_PENDING - set(found))
    assert not done, f"no private imports left, remove them from PRIVATE_IMPORT_PENDING: {done}"


# ------------------------------------------------------------------ defaults, defined once

# Files that still repeat a value of mlx_stream/defaults.py, each to be fixed (then
# removed here): a module-level ``DEFAULT_*`` defaults.py defines, or a literal default
# for a parameter or field named like one of its values.
DEFAULTS_PENDING = {
    "mlx_stream/serve/admission.py",
    "mlx_stream/serve/scheduler.py",
}
# Parameters and fields named like a default that hold another setting on purpose:
# ``(path, name)``, each with its reason.
NOT_THE_DEFAULT = {
    ("mlx_stream/eval/needle.py", "window"): "the needle eval's own window, recall's",
    ("mlx_stream/generate/session.py", "stop_loops"): "off in the library; chat asks",
    ("mlx_stream/generate/decode.py", "stop_loops"): "off in the library; chat asks",
    ("mlx_stream/serve/engine.py", "repair_tokens"): "off in the library; serve asks",
    ("mlx_stream/serve/sessions.py", "repair_tokens"): "the engine's, off in the library",
    ("mlx_stream/generate/session.py", "sinks"): "a session's state: the sinks pinned",
    ("mlx_stream/serve/matching.py", "sinks"): "an entry's state: the sinks pinned",
}


def default_names() -> dict[str, str]:
    """``{parameter name: DEFAULT_ name}`` of defaults.py (``window``: DEFAULT_WINDOW)."""
    from mlx_stream import defaults

    return {
        n.removeprefix("DEFAULT_").lower(): n for n in vars(defaults) if n.startswith("DEFAULT_")
    }


def repeated_defaults(source: str, names: dict[str, str]) -> list[str]:
    """Where ``source`` repeats a default: a module-level assignment of one of the
    ``DEFAULT_*`` names, or a number literal as the default of a parameter (or a class
    field) named by ``names``."""
    tree = ast.parse(source)
    found = []
    defined = set(names.values())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        targets = [node.target] if isinstance(node, ast.AnnAssign) else targets
        found += [t.id for t in targets if isinstance(t, ast.Name) and t.id in defined]

    def literal(value) -> bool:
        return (
            isinstance(value, ast.Constant)
            and isinstance(value.value, int | float)
            and not isinstance(value.value, bool)
        )

    for node in ast.walk(tree):
        pairs = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs += zip(positional[len(positional) - len(a.defaults) :], a.defaults)
            pairs += zip(a.kwonlyargs, a.kw_defaults)
            pairs = [(arg.arg, value) for arg, value in pairs]
        elif isinstance(node, ast.ClassDef):
            pairs = [
                (s.target.id, s.value)
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            ]
        found += [name for name, value in pairs if name in names and literal(value)]
    return found


def test_the_defaults_check_finds_planted_ones():
    names = default_names()
    assert names["kv_group_size"] == "DEFAULT_KV_GROUP_SIZE" and names["slack"] == "DEFAULT_SLACK"
    code = (
        "from mlx_stream.defaults import DEFAULT_WINDOW\n"
        "DEFAULT_SINKS = 4\n"
        "def f(x, window=DEFAULT_WINDOW, slack=64, *, kv_group_size=64, other=3): ...\n"
        "class S:\n"
        "    sinks: int = 4\n"
        "    flag: bool = False\n"
    )
    assert sorted(repeated_defaults(code, names)) == [
        "DEFAULT_SINKS",
        "kv_group_size",
        "sinks",
        "slack",
    ]


def test_every_default_is_defined_once_in_defaults_py():
    """A value defaults.py holds is imported from there, never written again (so two
    copies cannot disagree); a different value on purpose is listed with its reason."""
    names = default_names()
    found = {}
    for path, source in sources().items():
        if not path.startswith(("mlx_stream/", "cli/")) or path == "mlx_stream/defaults.py":
            continue
        hits = [h for h in repeated_defaults(source, names) if (path, h) not in NOT_THE_DEFAULT]
        if hits:
            found[path] = hits
    new = {path: hits for path, hits in found.items() if path not in DEFAULTS_PENDING}
    assert not new, f"defaults written again (import them from mlx_stream/defaults.py): {new}"
    done = sorted(DEFAULTS_PENDING - set(found))
    assert not done, f"no repeated defaults left, remove them from DEFAULTS_PENDING: {done}"
