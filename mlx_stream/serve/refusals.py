"""The ways the serving engine refuses one request.

Contract: raised by the engine's parts (:mod:`~mlx_stream.serve.admission`,
:mod:`~mlx_stream.serve.store`, :mod:`~mlx_stream.serve.matching`) and carried to the
request by the worker in a :class:`~mlx_stream.serve.event_types.Failed` event; the
server goes on. Imports nothing from the engine, so every part can raise them.
"""

from __future__ import annotations

from mlx_stream.errors import RuntimeFailure, UserError

DEFAULT_RETRY_AFTER = 2  # seconds a refused client is told to wait


class Busy(Exception):
    """No memory for another session now: every resident session is busy; the client
    may ask again after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = DEFAULT_RETRY_AFTER):
        super().__init__(message)
        self.retry_after = retry_after


class BadRequest(UserError):
    """A request the engine cannot serve as asked, with one line saying why."""


class TooLarge(BadRequest):
    """A prompt over ``--max-prompt-tokens``, refused before any prefill."""


class Unsaved(RuntimeFailure):
    """The state folder is full or cannot be written: the session that could
    not be saved stays resident, only the request that needed its room is refused."""


class ShuttingDown(Exception):
    """The server is draining: a request queued or still prefilling does not run."""

    def __init__(self, message: str = "the server is shutting down"):
        super().__init__(message)


# A request's refusal, never a rank's loss (a sharded server goes on after one).
REFUSALS = (Busy, RuntimeFailure, UserError)  # Unsaved, TooLarge, BadRequest among them
