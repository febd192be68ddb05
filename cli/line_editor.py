"""The chat's input on a terminal: a prompt_toolkit line editor, and quiet keys while a
reply streams.

prompt_toolkit (what IPython and aider use) gives bracketed paste, history, and key
bindings; here:

* a paste is one message: a bracketed paste arrives as one key press, and lines that
  arrive together with more input still queued (a paste without bracketed paste) are
  joined too;
* ``\"\"\"`` opens a block that Enter continues until a line ends with ``\"\"\"``, and
  Esc then Enter (Alt-Enter) starts a new line anywhere;
* the history (up/down, Ctrl-R) is kept across chats in ``chat-history`` in the user
  cache folder (``$MLX_STREAM_HOME`` or the platform's).

Imported only by ``cli.chat`` once it knows it talks to a terminal, so that
``mlx-stream --help`` never loads prompt_toolkit.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

BLOCK = '"""'
HISTORY_FILE = "chat-history"


def history_path() -> Path:
    """Where the chat's history lives: beside the pulled models, in the user cache."""
    from mlx_stream.models.registry import home_dir

    return home_dir() / HISTORY_FILE


def open_block(text: str) -> bool:
    """Whether ``text`` starts a ``\"\"\"`` block that is not closed yet."""
    if not text.lstrip().startswith(BLOCK):
        return False
    body = text.lstrip()[len(BLOCK) :]
    return not body.rstrip().endswith(BLOCK)


def unwrap_block(text: str) -> str:
    """A message without the ``\"\"\"`` around it (text outside a block as it is)."""
    stripped = text.strip()
    if stripped.startswith(BLOCK):
        stripped = stripped[len(BLOCK) :]
        if stripped.endswith(BLOCK):
            stripped = stripped[: -len(BLOCK)]
    return stripped.strip("\n")


class LineEditor:
    """Reads one message per call from the terminal (raises ``EOFError`` on Ctrl-D at
    an empty prompt, ``KeyboardInterrupt`` on Ctrl-C)."""

    def __init__(self, prompt: str, history: Path | None = None):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.filters import Condition
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings

        self.prompt = prompt
        bindings = KeyBindings()

        @bindings.add("escape", "enter")
        def _newline(event) -> None:  # Esc-Enter / Alt-Enter: a new line, never send
            event.current_buffer.insert_text("\n")

        def pasting() -> bool:
            # More keys already queued behind this Enter: lines pasted without bracketed
            # paste, which must stay one message.
            app = self.session.app
            return bool(app.key_processor.input_queue)

        def continuing() -> bool:
            return open_block(self.session.default_buffer.text) or pasting()

        stored = None
        if history is not None:
            with contextlib.suppress(OSError):
                history.parent.mkdir(parents=True, exist_ok=True)
                history.touch(mode=0o600, exist_ok=True)
                stored = FileHistory(str(history))
        self.session = PromptSession(
            history=stored or InMemoryHistory(),
            key_bindings=bindings,
            multiline=Condition(continuing),  # Enter adds a line while this holds
            prompt_continuation=lambda width, *_: "." * (width - 1) + " ",
            enable_history_search=False,
        )

    def read(self) -> str:
        """The next message, ``\"\"\"`` blocks unwrapped."""
        return unwrap_block(self.session.prompt(self.prompt))


@contextlib.contextmanager
def quiet_keys(stream=None) -> Iterator[None]:
    """While a reply streams: keys typed are neither echoed into it nor run afterwards.

    Turns the terminal's echo off (Ctrl-C still raises SIGINT) and, on the way out,
    drops whatever was typed meanwhile. Does nothing where ``stream`` (default stdin)
    is not a terminal.
    """
    stream = stream or sys.stdin
    try:
        import termios

        fd = stream.fileno()
        saved = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError, AttributeError):
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ECHONL)
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            termios.tcflush(fd, termios.TCIFLUSH)
            termios.tcsetattr(fd, termios.TCSANOW, saved)
