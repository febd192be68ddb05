"""``mlx-stream chat`` in a real pseudo-terminal: prompt, streaming, Ctrl-C mid-reply
returns to the prompt with the conversation intact, Ctrl-D exits with status 0."""

from __future__ import annotations

import os
import sys
import time

import pytest

pexpect = pytest.importorskip("pexpect")

PROMPT = ">>>"  # the line editor draws the space after it as a cursor move


def test_ctrl_c_stops_a_reply_and_ctrl_d_exits(endless_model):  # noqa: F811
    child = pexpect.spawn(
        sys.executable,
        [
            "-c",
            "from cli.main import main; main()",
            "chat",
            "-m",
            str(endless_model),
            "--max-tokens",
            "100000",
            "--window",
            "64",
            "--temp",
            "0",  # greedy: the same reply every run
        ],  # fmt: skip
        encoding="utf-8",
        timeout=60,
        dimensions=(40, 200),
        # pexpect answers no cursor-position query: without this, a slow machine
        # prints prompt_toolkit's CPR warning, whose words the reply pattern matches.
        env={**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1"},
    )
    try:
        child.expect("/help for commands")
        child.expect_exact(PROMPT)
        child.sendline("hello there")
        child.expect(r"\w+ \w+ \w+ \w+")  # it is streaming a reply
        time.sleep(0.2)
        child.sendintr()
        # Back at the prompt after the stats line of the stopped reply.
        child.expect("stopped")
        child.expect_exact(PROMPT)
        child.sendline("/stats")
        child.expect(r"turns\s+1")
        child.expect_exact(PROMPT)
        child.sendline("the sea")
        # A full reply would take 100000 tokens: stop this one too.
        child.expect(r"\w+ \w+ \w+")
        child.sendintr()
        child.expect_exact(PROMPT)
        child.sendline("/stats")
        child.expect(r"turns\s+2")
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, (child.exitstatus, child.signalstatus)
