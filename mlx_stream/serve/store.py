"""The state folder: where ``serve`` keeps the sessions it evicted, across restarts.

Contract: a saved session is its files (``session-<hash>.*``, named by a hash of owner
and id, and with recall its store's folder) plus one record in ``index.json``, written
atomically, with each file's sha256 and size and the ``config`` its caches depend on.
:meth:`SessionStore.load` finds a previous run's sessions again (records whose files
are there and whose config is this run's; checksums checked at the session's next
load) and removes what no record names. :meth:`SessionStore.save` writes a session or
raises :class:`~mlx_stream.serve.refusals.Unsaved` (the previous record stays). The
engine decides what to save and when. In full: docs/serve.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_stream.errors import RuntimeFailure, UserError
from mlx_stream.generate.session import cache_count
from mlx_stream.serve import marks
from mlx_stream.serve.matching import Entry
from mlx_stream.serve.refusals import Unsaved

MAX_STORED = 256  # sessions kept on disk (oldest dropped)
INDEX = "index.json"  # the state folder's list of saved sessions and their checksums
RECALL = ".recall"  # the folder of a saved session's recall store (ChatSession.save)
# the files of a saved session (of its recall folder: the manifest)
SUFFIXES = (".safetensors", ".json", ".draft.safetensors", RECALL + "/manifest.json",
            ".mark.safetensors", ".mark.json", ".mark.draft.safetensors",
            ".base.safetensors", ".base.json", ".base.draft.safetensors")  # fmt: skip


class SessionStore:
    """The saved sessions of one state folder, by ``(owner, id)``.

    Args:
        state_dir (Path, optional): The folder. Default: a temporary folder, removed
            by :meth:`cleanup`.
        config (Callable[[], dict]): What saved caches depend on; an index written
            under another config is ignored at :meth:`load`.
    """

    def __init__(self, state_dir: str | Path | None, config: Callable[[], dict[str, Any]]):
        self._tmp = None
        if state_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="mlx-stream-sessions-")
            state_dir = self._tmp.name
        self.state_dir = Path(state_dir)
        self.config = config
        self.records: dict[tuple, dict] = {}  # index records of saved sessions, by key
        self.scratch = False  # set: a folder that outlives nothing from now on (exit)

    @property
    def temporary(self) -> bool:
        """Whether the folder is a temporary one (it outlives nothing)."""
        return self._tmp is not None or self.scratch

    def cleanup(self) -> None:
        """Remove a temporary folder."""
        if self._tmp is not None:
            self._tmp.cleanup()

    def path(self, owner: str, session_id: str) -> Path:
        """Where a session is saved (``PATH.safetensors``, ``PATH.json``)."""
        # The id may come from the client (X-Session-ID): the file is named by its hash,
        # so no id reads as a path out of the state folder.
        name = f"{owner}\0{session_id}".encode()
        return self.state_dir / ("session-" + hashlib.sha256(name).hexdigest()[:32])

    def save(self, entry: Entry) -> tuple[Path, dict]:
        """Save ``entry``'s resident session and list it in the index.

        Returns:
            ``(path, record)``: where it went and its index record.

        Raises:
            Unsaved: The folder cannot take it (its previous record, if any, stays).
        """
        path = self.path(entry.owner, entry.id)
        session, before = entry.session, self.records.get(entry.key)
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)  # deleted under us
            session.save(path)
            marks.save(session, entry.marks, path)  # its newest mark, for a restart
            self.records[entry.key] = record = {
                "owner": entry.owner,
                "id": entry.id,
                "name": path.name,
                "system": entry.system,
                "tools": None if entry.tools is None else list(entry.tools.tools),
                "native_tools": None if entry.tools is None else entry.tools.native,
                "agent": entry.agent,  # the agent client's session key: found after a restart
                "messages": session.messages,
                "sinks": session.sinks,
                "tokens_seen": cache_count(session.caches),
                "saved": time.time(),
                "sha256": self.checksums(path),
            }
            record["bytes"] = self.sizes(record)
            self.write_index()
        except (OSError, RuntimeError, RuntimeFailure) as exc:  # mlx: RuntimeError "[write]
            if before is None:
                self.records.pop(entry.key, None)
            else:
                self.records[entry.key] = before
            cause = str(exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)
            raise Unsaved(
                f"the state folder {self.state_dir} is full or unwritable: "
                + (cause.splitlines() or ["?"])[0]
            ) from exc
        return path, record

    def forget(self, entry: Entry) -> None:
        """Remove ``entry``'s saved files and its index record (``entry.path`` is
        cleared)."""
        for suffix in SUFFIXES:
            with contextlib.suppress(OSError):
                (entry.path.parent / (entry.path.name + suffix)).unlink()
        shutil.rmtree(entry.path.with_name(entry.path.name + RECALL), ignore_errors=True)
        entry.path = None
        if self.records.pop(entry.key, None) is not None:
            with contextlib.suppress(OSError):  # a stale index names missing files: dropped
                self.write_index()

    @staticmethod
    def checksums(path: Path) -> dict[str, str]:
        """sha256 of each file of a saved session, by its name in the state folder."""
        sums = {}
        for suffix in SUFFIXES:
            file = path.parent / (path.name + suffix)
            if suffix == ".safetensors" or file.exists():
                digest = hashlib.sha256()
                with open(file, "rb") as f:
                    for block in iter(lambda f=f: f.read(1 << 20), b""):
                        digest.update(block)
                sums[path.name + suffix] = digest.hexdigest()
        return sums

    def sizes(self, record: dict) -> dict[str, int]:
        """Bytes of each file a record names (``OSError`` if one is missing)."""
        return {name: (self.state_dir / name).stat().st_size for name in record["sha256"]}

    def check(self, entry: Entry) -> None:
        """:class:`UserError` unless ``entry``'s files are what its index record says."""
        record = self.records.get(entry.key)
        try:
            intact = record is not None and self.checksums(entry.path) == record["sha256"]
        except OSError as exc:
            raise UserError(f"{entry.path}: {exc.strerror or exc}") from exc
        if not intact:
            raise UserError(f"{entry.path}: changed since it was saved")

    def write_index(self) -> None:
        """Write ``index.json`` (atomically): every saved session, oldest first."""
        from mlx_stream.generate.session import write_text_atomic

        records = sorted(self.records.values(), key=lambda r: r["saved"])
        index = {"version": 1, "config": self.config(), "sessions": records}
        write_text_atomic(self.state_dir / INDEX, json.dumps(index, ensure_ascii=False) + "\n")

    def load(self, discard: bool = False) -> list[Entry]:
        """Find the sessions a previous run saved: each index record whose files are
        there, with their sizes, comes back as an entry on disk (loaded on its next
        request, after their checksums: reading every file here would slow every
        start); the files of any other (and whatever else this store wrote,
        ``session-*`` and temporaries of them, that no record names) are removed.

        Args:
            discard (bool): Find none (a cluster's ranks' folders may disagree).
        """
        from mlx_stream.generate.session import STATE_FIELDS
        from mlx_stream.serve.tools import ToolSet

        with contextlib.suppress(OSError):
            self.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            index = json.loads((self.state_dir / INDEX).read_text("utf-8"))
            records = list(index["sessions"])[-MAX_STORED:]
            if index.get("config") != self.config():
                records = []
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            records = []
        if discard:
            records = []
        wall, now, named, found = time.time(), time.monotonic(), set(), []
        for r in records:
            try:
                path = self.path(r["owner"], r["id"])
                ok = (
                    r["name"] == path.name
                    and STATE_FIELDS["system"][1](r["system"])
                    and STATE_FIELDS["messages"][1](r["messages"])
                    and path.name + ".safetensors" in r["sha256"]
                    and set(r["sha256"]) <= {path.name + x for x in SUFFIXES}
                    and self.sizes(r) == r["bytes"]
                )
                tools = None
                if r["tools"] is not None:  # its serve.tools.ToolSet
                    tools = ToolSet(tuple(str(t) for t in r["tools"]), bool(r["native_tools"]))
                entry = Entry(
                    id=r["id"], owner=r["owner"], system=r["system"], messages=r["messages"],
                    path=path, tools=tools, agent=str(r.get("agent", "")),
                    tokens_seen=int(r["tokens_seen"]), sinks=int(r["sinks"]),
                    last_used=now - max(0.0, wall - float(r["saved"])),
                )  # fmt: skip
            except (OSError, KeyError, TypeError, ValueError, AttributeError):
                ok = False
            if ok:
                found.append(entry)
                self.records[entry.key] = r
                named.update(name.split("/", 1)[0] for name in r["sha256"])
        with contextlib.suppress(OSError):
            for file in self.state_dir.iterdir():
                ours = file.name.startswith(("session-", ".session-", f".{INDEX}."))
                if ours and file.name not in named:
                    if file.is_dir() and not file.is_symlink():  # a recall store's folder
                        shutil.rmtree(file, ignore_errors=True)
                    elif file.is_file():
                        file.unlink()
            self.write_index()
        return found
