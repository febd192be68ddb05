"""The wheel puts no top-level `cli` package on a user's path (it would collide with any
other distribution shipping one): the repository's cli/ folder installs as
`mlx_stream_cli` (hatch_build.py), and the console script points there."""

import subprocess
import sys
import zipfile

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from tests.support.paths import REPO


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_config_ships_cli_under_its_own_name():
    wheel = pyproject()["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert "cli" not in wheel["packages"]
    assert wheel["hooks"]["custom"]["path"] == "hatch_build.py"
    assert pyproject()["project"]["scripts"]["mlx-stream"] == "mlx_stream_cli.main:main"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if built.returncode != 0:  # no pip, or no way to fetch hatchling
        pytest.skip(f"could not build the wheel: {built.stderr[-500:]}")
    (path,) = out.glob("*.whl")
    return zipfile.ZipFile(path)


def test_wheel_has_no_top_level_cli(wheel):
    top = {name.split("/")[0] for name in wheel.namelist()}
    assert "cli" not in top
    assert {n for n in top if not n.endswith(".dist-info")} == {"mlx_stream", "mlx_stream_cli"}
    assert "mlx_stream_cli/main.py" in wheel.namelist()
    (entry_points,) = [n for n in wheel.namelist() if n.endswith("entry_points.txt")]
    assert "mlx-stream = mlx_stream_cli.main:main" in wheel.read(entry_points).decode()


def test_installed_cli_imports_without_the_checkout(wheel, tmp_path):
    wheel.extractall(tmp_path / "site")
    code = (
        "import sys, pathlib\n"
        # nothing that holds a cli/ package (the checkout, an editable install's root)
        "sys.path = [p for p in sys.path if p and not (pathlib.Path(p) / 'cli' / '__init__.py').exists()]\n"
        f"sys.path.insert(0, {str(tmp_path / 'site')!r})\n"
        "import mlx_stream_cli.main\n"
        "assert not any(m == 'cli' or m.startswith('cli.') for m in sys.modules)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr[-2000:]
