"""Admission by bytes: what the resident sessions and shared snapshots cost, and what
to evict, least recently used first, so that they fit the memory budget.

Contract: ``weights + snapshots + resident sessions x bytes <= budget`` (and at most
``max_sessions`` resident) holds after every :meth:`Admission.make_room`. A session
costs :data:`COPIES` times its caches (measured once per sink count) plus what it
holds whatever its checkpoints (``fixed``); a snapshot its caches once. Room is made
by evicting idle sessions (the ``evict`` callback) and snapshots, never a busy one;
where even that would not make room nothing is evicted and the request is refused
(:class:`~mlx_stream.serve.refusals.Busy` while a session is busy, else
:class:`~mlx_stream.serve.refusals.BadRequest`). Pure bookkeeping: no MLX work, no
files. In full: ``docs/serve.md``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from mlx_stream.generate.session import Checkpoint
from mlx_stream.serve.marks import MARKS
from mlx_stream.serve.matching import Entry
from mlx_stream.serve.refusals import BadRequest, Busy

MAX_SNAPSHOTS = 8  # shared system-prompt snapshots kept (least recently used dropped)
COPIES = 2 + MARKS  # copies of its caches a session holds: its own, a checkpoint, its marks


def weights_bytes(model: Any) -> int:
    """Bytes of a model's parameters."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def physical_memory() -> int:
    """Bytes of memory of this machine (0 when unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


class Admission:
    """The byte budget of one engine's sessions and snapshots.

    Args:
        entries (dict): The engine's sessions by ``(owner, id)`` (read, never
            changed here: a resident one costs its ``bytes``).
        weights (int): Bytes of the model's weights (always resident).
        budget (int, optional): Memory budget in bytes. Default: 75% of the machine.
        max_sessions (int, optional): Most resident sessions. Default: no limit.
        measure (Callable[[int], int]): Bytes of one session's caches with the given
            number of sinks (called once per sink count).
        evict (Callable[[Entry], None]): Save an idle resident session and free it
            (raises to refuse the request that needed the room).
        fixed (Callable[[int], int], optional): Bytes a session with the given
            number of sinks holds once, beside its caches and their copies.
            Default: none.
        copies (int): Copies of its caches a resident session holds. Default:
            :data:`COPIES` (2 for sessions that keep no marks).
    """

    def __init__(
        self,
        entries: dict[tuple[str, str], Entry],
        weights: int,
        budget: int | None,
        max_sessions: int | None,
        *,
        measure: Callable[[int], int],
        evict: Callable[[Entry], None],
        fixed: Callable[[int], int] | None = None,
        copies: int = COPIES,
    ):
        self.entries, self.weights, self.max_sessions = entries, weights, max_sessions
        self.budget = budget if budget else int(physical_memory() * 0.75) or 1 << 62
        self.measure, self.evict, self.fixed = measure, evict, fixed or (lambda sinks: 0)
        self.copies = copies
        self.snapshots: dict[str, tuple[Checkpoint, int]] = {}  # least recently used first
        self.bytes_by_sinks: dict[int, int] = {}
        self._snapshot_used: dict[str, float] = {}  # when each snapshot was last used

    def session_bytes(self, sinks: int) -> int:
        """Bytes of one resident session with ``sinks`` sinks: its caches and their
        copies (checkpoint, marks), measured once from real caches (after their one allocation), and
        what it holds once (``fixed``)."""
        if sinks not in self.bytes_by_sinks:
            self.bytes_by_sinks[sinks] = self.copies * self.measure(sinks) + self.fixed(sinks)
        return self.bytes_by_sinks[sinks]

    def cache_bytes(self, sinks: int) -> int:
        """Bytes of one copy of a session's caches (a snapshot's cost)."""
        return (self.session_bytes(sinks) - self.fixed(sinks)) // self.copies

    def single_bytes(self, sinks: int) -> int:
        """Bytes of a session without a checkpoint (a plain completion)."""
        return self.cache_bytes(sinks) + self.fixed(sinks)

    def used_bytes(self) -> int:
        """Weights + snapshots + resident sessions."""
        snaps = sum(b for _, b in self.snapshots.values())
        return self.weights + snaps + sum(e.bytes for e in self.entries.values() if e.session)

    def fits(self, need: int, keep: Entry, head: str | None = None) -> bool:
        """Whether :meth:`make_room` can make room for ``need`` more bytes."""
        return self._room(need, keep, self._evictable(keep, head))

    def make_room(self, need: int, keep: Entry, head: str | None = None) -> None:
        """Evict idle sessions and shared snapshots, least recently used first, until
        ``need`` more bytes fit the budget (and, while ``keep`` is not resident, one
        more session fits the count). Never what is in use: busy sessions, ``keep``,
        the snapshot of the system prompt ``head``. Nothing is evicted when even all
        of that would not make room: :class:`Busy` if a session is busy (room comes
        back), else :class:`BadRequest` (the budget can never hold it)."""
        if not self.fits(need, keep, head):
            busy = sum(e.busy for e in self.entries.values() if e.session is not None)
            if not busy:
                raise BadRequest(
                    f"no memory for this session: it needs {need:,} bytes and the "
                    f"--memory-budget ({self.budget:,} bytes) cannot hold them"
                )
            raise Busy(
                f"no memory for another session: {busy} sessions are busy "
                f"({self.used_bytes():,} of {self.budget:,} bytes); retry shortly"
            )
        while not self._room(need, keep, []):
            _, what = min(self._evictable(keep, head), key=lambda t: t[0])
            if isinstance(what, Entry):
                self.evict(what)
            else:
                self._forget_snapshot(what)

    def add_snapshot(self, head: str, checkpoint: Checkpoint, size: int) -> None:
        """Keep ``checkpoint`` (``size`` bytes, room made for it) as the shared
        snapshot of the system prompt ``head``."""
        self.snapshots[head] = (checkpoint, size)
        self.touch_snapshot(head)

    def touch_snapshot(self, head: str) -> None:
        """Mark ``head``'s snapshot used now; the least recently used beyond
        :data:`MAX_SNAPSHOTS` are dropped."""
        self.snapshots[head] = self.snapshots.pop(head)  # most recently used last
        self._snapshot_used[head] = time.monotonic()
        while len(self.snapshots) > MAX_SNAPSHOTS:
            self._forget_snapshot(next(iter(self.snapshots)))

    def _evictable(self, keep: Entry, head: str | None) -> list[tuple[float, Any]]:
        """``(last used, entry or snapshot key)`` of what may be evicted now."""
        out: list[tuple[float, Any]] = [
            (e.last_used, e)
            for e in self.entries.values()
            if e.session is not None and not e.busy and e is not keep
        ]
        out += [(self._snapshot_used.get(h, 0.0), h) for h in self.snapshots if h != head]
        return out

    def _room(self, need: int, keep: Entry, gone: list[tuple[float, Any]]) -> bool:
        """Whether ``need`` more bytes (and ``keep``, if not resident) fit once
        ``gone`` (from :meth:`_evictable`) is evicted."""
        freed = sessions = 0
        for _, what in gone:
            if isinstance(what, Entry):
                freed, sessions = freed + what.bytes, sessions + 1
            else:
                freed += self.snapshots[what][1]
        resident = sum(e.session is not None for e in self.entries.values()) - sessions
        count = resident + (keep.session is None)
        if self.max_sessions is not None and count > self.max_sessions:
            return False
        return self.used_bytes() - freed + need <= self.budget

    def _forget_snapshot(self, head: str) -> None:
        self.snapshots.pop(head, None)
        self._snapshot_used.pop(head, None)


MIN_SESSIONS = 4  # sessions the default window leaves room for, each with its checkpoint
MIN_WINDOW = 256


def default_window(
    context: int | None, token_bytes: int, free: int, pin: int, stride: int = 64
) -> int:
    """``serve``'s window when none is given: the model's trained ``context`` less the
    pinned system prompt (positions never reach past what it was trained on), cut to
    what ``free`` bytes (the budget less the weights) hold for :data:`MIN_SESSIONS`
    sessions of ``pin + window`` tokens at ``token_bytes`` each, :data:`COPIES` times;
    a multiple of ``stride``, at least :data:`MIN_WINDOW`."""
    window = (context or 4096) - pin
    if token_bytes > 0:
        window = min(window, free // (COPIES * MIN_SESSIONS * token_bytes) - pin)
    return max(MIN_WINDOW, window // stride * stride)


def token_bytes(model: Any, cache: Any) -> int:
    """Bytes one token takes in a session's caches of ``model`` under the ``cache``
    policy (its KV quantization); 0 for a model without unbounded KV layers."""
    from mlx_stream.cache.estimate import cache_bytes, model_layout

    layout, probe = model_layout(model), 1024
    if layout is None:
        return 0
    quant = {"kv_bits": cache.kv_bits, "kv_group_size": cache.kv_group_size,
             "key_bits": cache.key_bits}  # fmt: skip
    return cache_bytes(layout, 0, probe, **quant) // probe


def window_for(model: Any, context: int | None, cache: Any, budget: int | None) -> int:
    """:func:`default_window` of a loaded ``model`` under the ``cache`` policy (its KV
    quantization) and ``budget`` (default: 75% of the machine, as :class:`Admission`);
    ``context`` defaults to the model's ``max_position_embeddings``."""
    from mlx_stream.defaults import DEFAULT_PIN_TOKENS

    args = getattr(model, "args", None)
    context = context or getattr(args, "max_position_embeddings", None)
    budget = budget or int(physical_memory() * 0.75) or 1 << 62
    free = max(0, budget - weights_bytes(model))
    per = token_bytes(model, cache)
    return default_window(context, per, free, DEFAULT_PIN_TOKENS, cache.stride)


AUTO_SESSIONS = 8  # sessions (with checkpoints) the default budget holds at the full window
AUTO_SNAPSHOTS = 2  # and shared system-prompt snapshots


def auto_budget(model: Any, cache: Any, sessions: int = AUTO_SESSIONS) -> int | None:
    """``serve --memory-budget auto``: the weights and ``sessions`` sessions of
    ``cache``'s window with a full pinned system prompt, each with its copies, and
    :data:`AUTO_SNAPSHOTS` snapshots, at most 75% of the machine (a few clients never
    take the machine; more sessions evict idle ones to disk). ``None`` when the bytes of
    a token are unknown (75% of the machine then, as :class:`Admission`)."""
    from mlx_stream.defaults import DEFAULT_PIN_TOKENS

    per = token_bytes(model, cache)
    if per <= 0:
        return None
    session = (cache.sinks + DEFAULT_PIN_TOKENS + cache.window) * per
    want = weights_bytes(model) + (COPIES * sessions + AUTO_SNAPSHOTS) * session
    machine = int(physical_memory() * 0.75)
    return min(want, machine) if machine else want
