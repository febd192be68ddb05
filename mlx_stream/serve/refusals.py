"""The ways the serving engine refuses one request (their HTTP statuses: ``statuses``).

Contract: raised by the engine's parts (:mod:`~mlx_stream.serve.admission`,
:mod:`~mlx_stream.serve.store`, :mod:`~mlx_stream.serve.matching`) and turned into an
``("error", status, message, retry_after)`` event by the worker
(:mod:`~mlx_stream.serve.scheduler`, with :mod:`~mlx_stream.serve.statuses`); the server
goes on. Imports nothing from the engine, so every part can raise them.
"""

from __future__ import annotations

from mlx_stream.errors import RuntimeFailure, UserError

DEFAULT_RETRY_AFTER = 2  # seconds a refused client is told to wait


class Busy(Exception):
    """No memory for another session now: every resident session is busy (HTTP 429)."""

    def __init__(self, message: str, retry_after: int = DEFAULT_RETRY_AFTER):
        super().__init__(message)
        self.retry_after = retry_after


class BadRequest(UserError):
    """A request the engine cannot serve as asked (HTTP 400), with one line saying why."""


class TooLarge(BadRequest):
    """A prompt over ``--max-prompt-tokens`` (HTTP 413), refused before any prefill."""


class Unsaved(RuntimeFailure):
    """The state folder is full or cannot be written (HTTP 507): the session that could
    not be saved stays resident, only the request that needed its room is refused."""
