"""User-facing errors shared by every engine module.

The engine raises these for problems a user can act on; the CLI prints ``str(error)``
on one line and exits with ``error.exit_code`` (no traceback). Anything else is a bug.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input a user can fix: an unknown model, a malformed registry, a bad file.

    The message is one line and names the thing at fault. Exit code 2.
    """

    exit_code = 2


class RuntimeFailure(UserError):
    """A failure outside the user's input: network, disk, a source that is down.

    Exit code 1.
    """

    exit_code = 1


class Unsupported(UserError, ValueError):
    """A cache the engine cannot build or serve exactly: impossible sizes, a model
    layer whose positions it cannot move, a call or rollback it cannot do exactly.

    Refused before anything is written, with one line saying why. Exit code 2. Also a
    ``ValueError``, so callers that catch bad values keep working.
    """
