"""Several models behind one ``serve``: each its own :class:`~mlx_stream.serve.engine.Engine`
(its own worker, session table and state folder), loaded on first use, unloaded least
recently used when the memory budget needs room or after its keep-alive.

Contract: :class:`Models` maps a request's ``model`` to a started engine
(:meth:`Models.get`), loading it through the opener it is given (one load at a time;
requests for the model being loaded wait for it). Before a new model serves, idle
models are unloaded, least recently used first, until the loaded ones' bytes (weights
and sessions, as each engine counts them) and the new one's weights and one session fit
the budget; when only busy ones are left it is refused (:class:`NoRoom`). Unloading a
model saves its sessions to its state folder, where loading it again finds them. Engines
share one :class:`Turns`: a worker takes it around each scheduler round, a load around
reading the weights, so one model computes at a time (MLX's streams are not meant for
two threads at once).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_stream.errors import RuntimeFailure, UserError
from mlx_stream.serve.refusals import DEFAULT_RETRY_AFTER

DEFAULT = "default"  # the name a request may use for the first model
TICK = 1.0  # seconds between the keep-alive checks


class NotServed(UserError):
    """A name this server serves no model under."""


class LoadFailed(RuntimeFailure):
    """A model that could not be loaded (its one-line reason); the others serve on."""


class NoRoom(Exception):
    """No room for a model: every other loaded model is busy; ask again later."""

    def __init__(self, message: str, retry_after: int = DEFAULT_RETRY_AFTER):
        super().__init__(message)
        self.retry_after = retry_after


class Turns:
    """A lock granted in the order it was asked for (a worker that releases it and asks
    again waits behind the other worker): only its holder runs MLX work."""

    def __init__(self):
        self._cond = threading.Condition()
        self._next = self._serving = 0

    def __enter__(self) -> Turns:
        with self._cond:
            ticket, self._next = self._next, self._next + 1
            self._cond.wait_for(lambda: self._serving == ticket)
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


def parse_keep_alive(value: str | int | float | None) -> float | None:
    """Seconds a model stays loaded after its last request (ollama's ``keep_alive``:
    ``"5m"``, ``"1h30m"``, ``"30s"``, a number of seconds; negative: forever, ``None``).

    Raises:
        UserError: A value that is none of these.
    """
    import re

    if isinstance(value, int | float) and not isinstance(value, bool):
        return None if value < 0 else float(value)
    text = str(value).strip().lower()
    if re.fullmatch(r"-\d+(\.\d+)?[a-z]*", text):
        return None
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise UserError(f"keep_alive: a duration like 5m, 1h, 30s, 0 or -1 (got {value!r})")
    scale = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * scale[u] for n, u in parts)


def servable(name: str) -> bool:
    """Whether a request may load ``name`` without it being given at start: a registry
    model already pulled or a Hugging Face id in the local caches (never a path: a
    client does not choose the server's files)."""
    from mlx_stream.models import hub, loader, registry

    if name in registry.load_registry().models:
        return loader.is_pulled(name)
    return hub.is_repo_id(name) and hub.find_local(name) is not None


@dataclass
class Slot:
    """A loaded model: its engine, the names it answers to and its keep-alive."""

    engine: Any
    names: set[str]
    keep_alive: float | None = None  # seconds after its last request; None: forever
    last_used: float = field(default_factory=time.monotonic)

    def used_bytes(self) -> int:
        """Weights and resident sessions, as the engine last published them."""
        memory = self.engine.stats.get("memory") or {}
        return int(memory.get("used_bytes") or self.engine.weights)

    def need_bytes(self) -> int:
        """The weights and one session: what the model needs to serve at all."""
        memory = self.engine.stats.get("memory") or {}
        return int(self.engine.weights + (memory.get("session_bytes") or 0))


class Models:
    """The models one server serves, the first always listed first.

    Args:
        first (Engine): The first model's engine, started (``-m``; a request without
            a model, or ``default``, gets it).
        aliases (tuple[str, ...]): The other names the first model answers to.
        opener (Callable, optional): ``opener(name) -> (engine, aliases)``: a model
            loaded and its engine built, not started; ``None``: one model only.
        find (Callable, optional): ``find(name) -> str | None``: the name a request may
            load a model under (``None``: not served here). Default: none but the first.
        offered (tuple[str, ...]): More names listed as servable (loaded or not).
        budget (int, optional): Bytes for every loaded model's weights and sessions.
            Default: none (models are unloaded by their keep-alive only).
        keep_alive (float, optional): Seconds a model stays loaded after its last
            request (0: at once). Default: forever.
        turns (Turns, optional): The engines' shared lock (loads take it too).
    """

    def __init__(
        self, first: Any, aliases: tuple[str, ...] = (), *, opener: Callable | None = None,
        find: Callable[[str], str | None] | None = None, offered: tuple[str, ...] = (),
        budget: int | None = None, keep_alive: float | None = None, turns: Any = None,
    ):  # fmt: skip
        self.default = first.model_id
        self.opener, self.find, self.budget, self.turns = opener, find, budget, turns
        self.keep_alive = keep_alive
        self.offered = [self.default, *(n for n in offered if n != self.default)]
        self.slots: dict[str, Slot] = {}  # by model id, least recently used first
        self._cond = threading.Condition()
        self._loading: set[str] = set()
        self.needs: dict[str, int] = {}  # bytes each model loaded before needs to serve
        self._load_lock = threading.Lock()  # one load at a time
        self._unload_lock = threading.Lock()  # one unload at a time (a stopped worker
        # answers no call: the second of two unloads of one model must find it gone)
        self._add(first, aliases, keep_alive)
        self._ticker: threading.Thread | None = None
        self._closed = False

    # ----- lookup -----------------------------------------------------------------

    @property
    def first(self) -> Any:
        """The first model's engine when it is loaded, else ``None``."""
        slot = self.slots.get(self.default)
        return slot.engine if slot is not None else None

    def loaded_id(self, name: str | None) -> str | None:
        """The id of the loaded model ``name`` names (``None``/``default``: the
        first), or ``None`` when none loaded answers to it."""
        name = self.default if name in (None, DEFAULT) else name
        with self._cond:
            for model_id, slot in self.slots.items():
                if name == model_id or name in slot.names:
                    return model_id
        return None

    def ready(self, name: str | None) -> Any:
        """The engine of ``name`` if loaded (marked used now), else ``None``."""
        model_id = self.loaded_id(name)
        if model_id is None:
            return None
        with self._cond:
            slot = self.slots.get(model_id)
            if slot is None:
                return None
            self._touch(model_id, slot)
        self.rebalance(slot.engine)
        return slot.engine

    def resolve(self, name: str | None) -> str:
        """The id ``name`` is served under (loaded or not).

        Raises:
            NotServed: No model answers to ``name``.
        """
        model_id = self.loaded_id(name)
        if model_id is not None:
            return model_id
        name = self.default if name in (None, DEFAULT) else name
        found = self.find(name) if self.opener is not None and self.find else None
        if found is None:
            raise NotServed(f"model {name!r} is not served here ({self.served()})")
        return found

    def served(self) -> str:
        """The served names in words, for a 404's message."""
        if self.opener is None:
            return f"this server serves {self.default!r}"
        return "this server serves " + ", ".join(repr(n) for n in self.offered)

    def get(self, name: str | None) -> Any:
        """The started engine of ``name``, loaded first if needed (blocks while it
        loads; any thread but an engine's worker).

        Raises:
            NotServed: No model answers to ``name``.
            NoRoom: Not enough budget and every other model busy.
            LoadFailed: The model could not be loaded (its reason).
        """
        engine = self.ready(name)
        if engine is not None:
            return engine
        key = self.resolve(name)
        with self._cond:
            while key in self._loading:
                self._cond.wait()
            engine = self.ready(key)
            if engine is not None:
                return engine
            self._loading.add(key)
        try:
            with self._load_lock:
                return self._load(key, name)
        finally:
            with self._cond:
                self._loading.discard(key)
                self._cond.notify_all()

    def keep(self, engine: Any, keep_alive: float | None) -> None:
        """The model of ``engine`` stays loaded ``keep_alive`` seconds after its last
        request from now on (ollama's per-request ``keep_alive``)."""
        with self._cond:
            for slot in self.slots.values():
                if slot.engine is engine:
                    slot.keep_alive, slot.last_used = keep_alive, time.monotonic()
        self.start()

    # ----- loading and unloading -----------------------------------------------------

    def _load(self, key: str, asked: str | None) -> Any:
        if key in self.needs:  # loaded before: its room made before its weights are read
            self._make_room(self.needs[key])
        try:
            with self.turns or contextlib.nullcontext():
                engine, aliases = self.opener(key)
        except UserError as exc:
            raise LoadFailed(f"model {key!r} cannot be loaded: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - one line naming it; the others serve on
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise LoadFailed(f"model {key!r} cannot be loaded: {reason}") from None
        try:
            engine.start()
        except UserError as exc:
            raise LoadFailed(f"model {key!r} cannot be loaded: {exc}") from None
        self.needs[key] = need = Slot(engine, set()).need_bytes()
        if not self._make_room(need):
            self._stop(engine)
            raise NoRoom(
                f"no room to load model {key!r}: every loaded model is busy (ask again "
                "after Retry-After)"
            )
        names = {key, *aliases} | ({asked} if asked else set())
        self._add(engine, tuple(names), self.keep_alive)
        self.rebalance()
        return engine

    def _add(self, engine: Any, aliases: tuple[str, ...], keep_alive: float | None) -> None:
        names = {n for n in aliases if n not in (engine.model_id, DEFAULT)}
        with self._cond:
            self.slots[engine.model_id] = Slot(engine, names, keep_alive)

    def _make_room(self, need: int) -> bool:
        """Unload idle models, least recently used first, until ``need`` more bytes fit
        the budget; whether they fit."""
        if self.budget is None:
            return True
        for model_id in list(self.slots):
            used = sum(s.used_bytes() for s in self.slots.values())
            if used + need <= self.budget:
                return True
            self.unload(model_id)
        return sum(s.used_bytes() for s in self.slots.values()) + need <= self.budget

    def unload(self, model_id: str) -> bool:
        """Unload ``model_id`` if it is idle: its sessions saved to its state folder,
        its memory freed; whether it was."""
        with self._unload_lock:
            with self._cond:
                slot = self.slots.get(model_id)
            if slot is None:
                return False
            engine = slot.engine

            def close_if_idle() -> bool:  # on its worker: no request slips in between
                if engine.running:
                    return False
                engine.drain()
                return True

            if not engine.call(close_if_idle).result():
                return False
            with self._cond:
                self.slots.pop(model_id, None)
            self._stop(engine)
        self.rebalance()
        return True

    def _stop(self, engine: Any) -> None:
        engine.stop()  # saves every resident session to its state folder
        import gc

        import mlx.core as mx

        with self.turns or contextlib.nullcontext():
            gc.collect()
            mx.clear_cache()

    def rebalance(self, engine: Any = None) -> None:
        """A loaded engine's budget (``engine``'s, else every one's): the budget less
        what the other loaded models hold now (one model: the whole budget); set at
        each request, so one model's sessions grow into the room the others leave."""
        if self.budget is None:
            return
        with self._cond:
            slots = list(self.slots.values())
        used = {id(s.engine): s.used_bytes() for s in slots}
        total = sum(used.values())
        for slot in slots:
            if engine is None or slot.engine is engine:
                others = total - used[id(slot.engine)]
                slot.engine.budget = max(slot.need_bytes(), self.budget - others)

    def _touch(self, model_id: str, slot: Slot) -> None:
        slot.last_used = time.monotonic()
        self.slots[model_id] = self.slots.pop(model_id)  # most recently used last

    # ----- keep-alive -----------------------------------------------------------------

    def start(self) -> None:
        """Start the keep-alive checks (a daemon thread), once some model expires."""
        if self._ticker is not None or self.opener is None:
            return
        if self.keep_alive is None and all(s.keep_alive is None for s in self.slots.values()):
            return
        self._ticker = threading.Thread(target=self._tick, name="mlx-models", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._closed:
            time.sleep(TICK)
            self.expire(time.monotonic())

    def expire(self, now: float) -> None:
        """Unload every idle model whose keep-alive ran out by ``now``."""
        with self._cond:
            slots = list(self.slots.items())
        for model_id, slot in slots:
            if slot.engine.running:  # read off its worker: a hint, checked again there
                slot.last_used = now
            elif slot.keep_alive is not None and now - slot.last_used >= slot.keep_alive:
                self.unload(model_id)

    def close(self, save: bool = True) -> None:
        """Stop every loaded engine, their sessions saved (``save``: else their state
        folders are a scratch one, removed next)."""
        self._closed = True
        with self._cond:
            slots = list(self.slots.values())
            self.slots.clear()
        for slot in slots:
            slot.engine.store.scratch = not save
            slot.engine.stop()

    def drain(self) -> None:
        """Every engine stops taking requests (any thread: flags only)."""
        for slot in list(self.slots.values()):
            slot.engine.drain()

    # ----- listing ----------------------------------------------------------------------

    def listing(self) -> list[dict[str, Any]]:
        """What can be served: ``{"id", "loaded", "engine"}`` (engine: ``None`` when not
        loaded), the first model first, then the offered names, then others loaded."""
        with self._cond:
            slots = dict(self.slots)
        out, seen = [], set()
        for name in [*self.offered, *slots]:
            model_id = next((i for i, s in slots.items() if name == i or name in s.names), name)
            if model_id in seen:
                continue
            seen.add(model_id)
            slot = slots.get(model_id)
            out.append({"id": model_id, "loaded": slot is not None,
                        "engine": slot.engine if slot else None})  # fmt: skip
        return out

    def expires(self, model_id: str) -> float | None:
        """When (seconds since the epoch) the loaded ``model_id``'s keep-alive ends if
        no request comes; ``None``: never."""
        slot = self.slots.get(model_id)
        if slot is None or slot.keep_alive is None:
            return None
        return time.time() + max(0.0, slot.last_used + slot.keep_alive - time.monotonic())

    def names_of(self, model_id: str) -> list[str]:
        """The other names the loaded ``model_id`` answers to."""
        slot = self.slots.get(model_id)
        return sorted(slot.names) if slot is not None else []
