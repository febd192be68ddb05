"""Build hook: the repository's `cli/` folder ships as the package `mlx_stream_cli`.

A top-level package named `cli` in a wheel collides with any other distribution that
ships one, so the wheel never contains `cli/`:

- a regular wheel copies `cli/` to `mlx_stream_cli/`;
- an editable install (`pip install -e .`) gets a one-line `mlx_stream_cli/__init__.py`
  whose `__path__` is the checkout's `cli/` folder, so edits there take effect at once
  (the checkout's root is on `sys.path` as before, so `import cli...` keeps working in
  the tests and benchmarks).

The console script is `mlx_stream_cli.main:main` (pyproject.toml). This needs the modules
in `cli/` to import each other relatively (`from .common import ...`), not as `cli.`.
"""

import os
import tempfile

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

INSTALLED_NAME = "mlx_stream_cli"


class CliPackageHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return
        cli = os.path.join(self.root, "cli")
        if version == "editable":
            init = os.path.join(cli, "__init__.py")
            shim = os.path.join(tempfile.mkdtemp(prefix="mlx_stream_cli_"), "__init__.py")
            with open(shim, "w") as f:
                f.write(
                    '"""Editable install: the package is the checkout\'s cli/ folder."""\n'
                    f"__path__ = [{cli!r}]\n"
                    f"__file__ = {init!r}\n"
                    f"exec(compile(open(__file__).read(), __file__, 'exec'))\n"
                )
            build_data["force_include"][shim] = f"{INSTALLED_NAME}/__init__.py"
        else:
            build_data["force_include"][cli] = INSTALLED_NAME
