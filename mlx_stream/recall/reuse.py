"""Refreshes between full scans read a shortlist (the tier's index).

Only every ``RESCAN``-th decode refresh (``quest`` or ``mean``) scores every stored
block; it keeps the ``size`` best, and the refreshes in between score those plus every
block stored since that scan, the softmax over them alone. A rollback behind the scan
leaves the next refresh to scan; the blocks a prompt's end chooses join the shortlist.
Its selection is seldom the flat scan's between scans (the softmax over fewer blocks
weighs the query rows differently). Its state is a few hundred block numbers: host
memory it does not count. Why, and what it changes: docs/recall.md ("Refreshes from a
shortlist").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RESCAN = 16  # one refresh in this many scans every block


def shortlist_size(blocks: int) -> int:
    """Blocks a full scan keeps for a tier that recalls ``blocks``."""
    return max(8 * blocks, 64)


@dataclass(frozen=True)
class State:
    """The last full scan's ``ids`` (its best blocks, in stream order), the blocks
    stored when it ran (``at``) and the refreshes since (``since``)."""

    ids: tuple[int, ...]
    at: int
    since: int


class Shortlist:
    """What the next refresh scores (see the module docstring).

    Args:
        size (int): Blocks a full scan keeps.
        rescan (int): Every this many refreshes, one scans every block (``1``: all).
        state (State, optional): Where it stands (default: nothing scanned yet).
    """

    def __init__(self, size: int, rescan: int, state: State | None = None):
        self.size, self.rescan = int(size), int(rescan)
        self.state = state
        self.scans = self.reuses = 0  # refreshes that scanned, that read the shortlist

    @classmethod
    def of(cls, blocks: int) -> Shortlist:
        """The shortlist of a tier that recalls ``blocks`` (:func:`shortlist_size`,
        :data:`RESCAN`)."""
        return cls(shortlist_size(blocks), RESCAN)

    def candidates(self, blocks: int) -> np.ndarray | None:
        """The blocks a refresh over ``blocks`` stored blocks scores, ascending, or
        ``None``: every one (no scan yet, its turn, or a rollback behind the scan)."""
        s = self.state
        if s is None or s.since + 1 >= self.rescan or blocks < s.at:
            return None
        kept = [j for j in s.ids if j < blocks]
        return np.array(kept + list(range(s.at, blocks)), np.int64)

    def scored(self, total: np.ndarray, full: bool) -> None:
        """Take a refresh's scores ``total`` (``-inf``: not a candidate); ``full``:
        it scored every block (keep its best ``size``)."""
        if full:
            order = np.argsort(-total, kind="stable")[: self.size]
            ids = tuple(sorted(int(j) for j in order if np.isfinite(total[j])))
            self.state = State(ids, len(total), 0)
            self.scans += 1
        elif self.state is not None:
            s = self.state
            self.state = State(s.ids, s.at, s.since + 1)
            self.reuses += 1

    def include(self, chosen) -> None:
        """Keep blocks another selector ``chosen`` (a prompt's end: the question's
        choice) among the candidates until the next scan."""
        s = self.state
        if s is not None:
            ids = {*s.ids, *(int(j) for j in chosen if j < s.at)}
            self.state = State(tuple(sorted(ids)), s.at, s.since)

    def forget(self, blocks: int) -> None:
        """Blocks from ``blocks`` on are gone (a rollback): behind the last scan's, the
        next refresh scans."""
        if self.state is not None and blocks < self.state.at:
            self.state = None

    def export(self) -> dict | None:
        s = self.state
        return None if s is None else {"ids": list(s.ids), "at": s.at, "since": s.since}

    def restore(self, data: dict | None) -> None:
        self.state = None if data is None else State(
            tuple(int(j) for j in data["ids"]), int(data["at"]), int(data["since"]))  # fmt: skip
