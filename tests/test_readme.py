"""The README opens with exactly two commands, and CI runs the second one verbatim."""

import re

from tests.support.paths import REPO


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)


def test_readme_opens_with_two_one_line_commands():
    first, second = readme_commands()[:2]
    assert "\n" not in first and "\n" not in second
    assert first.endswith("mlx-stream chat")
    assert "pytest" in second and '".[test]"' in second


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci
