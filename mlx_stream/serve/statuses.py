"""The HTTP status each refusal of a request maps to, beside :mod:`~mlx_stream.serve.app`.

Contract: :func:`error_event` turns an exception that ended one request into the
worker's ``("error", status, message, retry_after)`` event; the HTTP side answers with
that status. Imports only the refusals, so the worker uses it without reaching up to
the routes.
"""

from __future__ import annotations

from mlx_stream.errors import RuntimeFailure, UserError
from mlx_stream.serve.refusals import Busy, TooLarge, Unsaved

# Most specific first: an Unsaved is a RuntimeFailure, a TooLarge a UserError.
STATUSES: tuple[tuple[type[BaseException], int], ...] = (
    (Busy, 429),  # no memory for another session now: try again after Retry-After
    (Unsaved, 507),  # the state folder is full: only this request is refused
    (RuntimeFailure, 500),  # the server's fault (a session it could not save)
    (TooLarge, 413),
    (UserError, 400),
)

REFUSALS = tuple(kind for kind, _ in STATUSES)  # a request's refusal, never a rank's loss
SHUTTING_DOWN = ("error", 503, "the server is shutting down", None)


def error_event(exc: BaseException) -> tuple:
    """The ``("error", status, message, retry_after)`` event for ``exc``; an
    unexpected one is a 500 naming its type."""
    for kind, status in STATUSES:
        if isinstance(exc, kind):
            return ("error", status, str(exc), getattr(exc, "retry_after", None))
    return ("error", 500, f"{type(exc).__name__}: {exc}", None)
