"""The HTTP side's one table from the exception that ended a request to its status.

Contract: :func:`status_of` turns a :class:`~mlx_stream.serve.event_types.Failed` event
into ``(status, message, retry_after)``: a refusal's status by its exception, 500
naming the exception's type for anything else or for a request that crashed while it
ran. The routes answer with it in their API's error body. Nothing below the routes
knows a status.
"""

from __future__ import annotations

from typing import NamedTuple

from mlx_stream.errors import RuntimeFailure, UserError
from mlx_stream.serve.event_types import Failed
from mlx_stream.serve.models import LoadFailed, NoRoom, NotServed
from mlx_stream.serve.refusals import Busy, ShuttingDown, TooLarge, Unsaved

# Most specific first: an Unsaved is a RuntimeFailure, a TooLarge a UserError.
STATUSES: tuple[tuple[type[BaseException], int], ...] = (
    (Busy, 429),  # no memory for another session now: try again after Retry-After
    (ShuttingDown, 503),
    (NoRoom, 503),  # no room to load a model now: try again after Retry-After
    (NotServed, 404),
    (LoadFailed, 500),  # a model that cannot be loaded: the others serve on
    (Unsaved, 507),  # the state folder is full: only this request is refused
    (RuntimeFailure, 500),  # the server's fault (a session it could not save)
    (TooLarge, 413),
    (UserError, 400),
)


class Status(NamedTuple):
    """What a failed request's response says."""

    status: int
    message: str
    retry_after: int | None = None

    def headers(self) -> dict[str, str] | None:
        """``Retry-After`` where the client should wait and ask again."""
        return {"Retry-After": str(self.retry_after)} if self.retry_after else None


def status_of(failed: Failed) -> Status:
    """The status for ``failed``; an unexpected error, or any raised while the request
    ran (``crashed``), is a 500 naming its type."""
    exc = failed.error
    if not failed.crashed:
        for kind, status in STATUSES:
            if isinstance(exc, kind):
                return Status(status, str(exc), getattr(exc, "retry_after", None))
    return Status(500, f"{type(exc).__name__}: {exc}")
