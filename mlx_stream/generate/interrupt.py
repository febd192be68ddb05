"""Ctrl-C as a flag: a terminal loop stops between model calls, never inside one."""

from __future__ import annotations

import signal
import threading


class StopOnInterrupt:
    """Turn Ctrl-C (and any other ``signals``) into a flag while a loop runs, so it
    stops between model calls.

    A ``KeyboardInterrupt`` raised inside a model call can leave a prompt cache torn;
    in the main thread this context manager records the signal instead, and the loop
    checks ``interrupted`` after each step and breaks (which closes a generator and
    leaves the cache consistent). A second signal raises ``KeyboardInterrupt`` at once.
    Elsewhere it does nothing.

    Args:
        signals (tuple): The signals to catch. Default: ``(SIGINT,)``; add
            ``SIGTERM`` for a batch job that should save its work when killed politely.

    Example:
        with StopOnInterrupt() as ctrl_c:
            for r in stream_generate(...):
                print(r.text, end="", flush=True)
                if ctrl_c.interrupted:
                    break
    """

    def __init__(self, signals: tuple = (signal.SIGINT,)):
        self.interrupted = False
        self.signals = signals
        self._previous: dict = {}

    def __enter__(self) -> StopOnInterrupt:
        current = signal.getsignal(signal.SIGINT)
        if getattr(current, "final", False):  # e.g. distributed: Ctrl-C ends every rank
            return self
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.signals}
        return self

    def _handle(self, signum, frame) -> None:
        if self.interrupted:  # a second signal stops at once
            raise KeyboardInterrupt
        self.interrupted = True

    def __exit__(self, *exc) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
