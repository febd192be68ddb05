"""The engine of ``mlx-stream serve``: chat sessions in fixed memory, admitted by bytes,
all model work on one MLX thread.

Contract: :class:`Engine` owns two parts with explicit dependencies: the session table
(:class:`~mlx_stream.serve.sessions.Sessions`: lifecycle, eviction, the state folder,
marks) and the worker (:class:`~mlx_stream.serve.scheduler.Scheduler`: thread, rounds,
jobs). It admits a request (planned by :mod:`~mlx_stream.serve.planning`) onto its
session, keeps the stats and re-exports the names the HTTP side imports. The design:
``docs/serve.md``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlx_stream.defaults import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_PIN_TOKENS
from mlx_stream.errors import UserError
from mlx_stream.generate.session import ChatSession, Reply, Settings, cache_count, clean_text
from mlx_stream.generate.steps import DecodeState
from mlx_stream.serve import marks
from mlx_stream.serve import recall as recalled
from mlx_stream.serve.admission import weights_bytes  # noqa: F401 - re-exported
from mlx_stream.serve.matching import Entry, split_messages
from mlx_stream.serve.planning import Planner
from mlx_stream.serve.reasoning import ThinkStream
from mlx_stream.serve.refusals import (
    DEFAULT_RETRY_AFTER,  # noqa: F401 - re-exported
    BadRequest,
    Busy,  # noqa: F401 - re-exported
    TooLarge,
    Unsaved,  # noqa: F401 - re-exported
)
from mlx_stream.serve.scheduler import DEFAULT_CHUNK, Request, Scheduler
from mlx_stream.serve.sessions import Sessions


class Engine:
    """Sessions and the one MLX worker thread that runs them: owns the session table
    (:attr:`sessions`, a :class:`~mlx_stream.serve.sessions.Sessions`: admitted by bytes,
    saved to the state folder) and the worker (:attr:`scheduler`, a
    :class:`~mlx_stream.serve.scheduler.Scheduler`); its other public names delegate to
    them.

    Args:
        model, tokenizer: The loaded model.
        settings (Settings): Session defaults (sinks, window, kv bits, max tokens...).
        model_id (str): The name the API serves the model under.
        draft_model: A draft model for speculative decoding.
        keep_system (bool): Make the rendered system prompt the sinks. Default: True.
        budget (int, optional): Memory budget in bytes. Default: 75% of the machine.
        max_sessions (int, optional): Most resident sessions. Default: no limit.
        state_dir (Path, optional): Where evicted sessions go, listed in its
            ``index.json`` (a restart with the same folder finds them again).
            Default: a temp folder.
        max_prompt_tokens (int): Most tokens one request may feed (``TooLarge`` over it).
        pin (int, optional): Most tokens of a rendered system prompt kept as sinks
            (``keep_system``); the rest of it flows through the window. Default:
            ``DEFAULT_PIN_TOKENS`` or the window if smaller.
        max_tokens_ceiling (int, optional): The operator's cap on any request's
            ``max_tokens``. Default: none (a request's own value is served).
        chunk (int): Tokens a request advances per scheduler round when not batched.
        batching (bool): Decode sessions together in one batched call per round.
            Default: True (refused, with the reason in the stats, where inexact).
        cluster (distributed.Cluster, optional): The ranks a sharded model runs on.
        isolate (bool): Never match a request without ``X-Session-ID`` to a session
            (each starts its own). Default: False (a request that extends one of its
            owner's transcripts continues that session).
        prefix_store (PrefixStore, optional): The prefix store on disk
            (:mod:`mlx_stream.prefix_store`): a system prompt with no shared snapshot
            yet is looked up there before it is prefilled, and put there after (so a
            restarted server, ``chat`` or another server start from it). Default: none.
        sampling (Sampling): What a request that gives no temperature samples with
            (:func:`mlx_stream.serve.sampling.resolve`). Default: greedy.
        repair_tokens (int): Tokens after an edit in the middle of a transcript computed
            again (:mod:`~mlx_stream.generate.repair`); 0: such a request is rebuilt.
            Default: 0.
        turns (optional): The lock the worker holds around each round, shared by
            several models' engines (:class:`~mlx_stream.serve.models.Turns`): one
            computes at a time. Default: none.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        settings: Settings,
        model_id: str,
        *,
        draft_model: Any = None,
        keep_system: bool = True,
        budget: int | None = None,
        max_sessions: int | None = None,
        state_dir: str | Path | None = None,
        chunk: int = DEFAULT_CHUNK,
        batching: bool = True,
        cluster: Any = None,
        isolate: bool = False,
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
        pin: int | None = None,
        max_tokens_ceiling: int | None = None,
        prefix_store: Any = None,
        sampling: Any = None,
        repair_tokens: int = 0,
        turns: Any = None,
    ):
        from mlx_stream.generate.model_config import Sampling

        self.model, self.tokenizer, self.draft_model = model, tokenizer, draft_model
        self.settings, self.model_id, self.cluster = settings, model_id, cluster
        self.sampling = sampling if sampling is not None else Sampling()  # greedy
        self.planner = Planner(
            tokenizer, self.sampling, settings, draft=draft_model is not None,
            max_prompt_tokens=max_prompt_tokens, max_tokens_ceiling=max_tokens_ceiling,
        )  # fmt: skip
        pin = min(DEFAULT_PIN_TOKENS, settings.cache.window) if pin is None else pin
        ids = None
        if cluster is not None:
            ids = random.Random(cluster.share_int(random.getrandbits(62)))
            if state_dir is not None:  # ranks on one machine must not share files
                state_dir = Path(state_dir) / f"rank-{cluster.rank}"
                state_dir.mkdir(exist_ok=True)
        self.sessions = Sessions(
            model, tokenizer, settings, model_id, draft_model=draft_model,
            keep_system=keep_system, pin=pin, budget=budget, max_sessions=max_sessions,
            state_dir=state_dir, isolate=isolate, prefixes=prefix_store,
            repair_tokens=repair_tokens, ids=ids,
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.sessions, self._admit, self._refresh, model, tokenizer, settings,
            drafting=draft_model is not None, chunk=chunk, batching=batching, cluster=cluster,
            turns=turns,
        )  # fmt: skip
        self.stats: dict[str, Any] = {}

    # ----- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker; measure a session's bytes first and refuse a budget
        that cannot hold the weights and one session. Sessions the state folder's
        index lists (and whose files are intact) are found again."""
        self.sessions.load(discard=self.cluster is not None)  # loaded on their next use
        self.scheduler.start()
        self.call(self.make_batch).result()
        sinks = self.settings.cache.sinks
        need = self.call(lambda: self.weights + self.session_bytes(sinks)).result()
        self.call(self.publish).result()
        if need > self.budget:
            self.stop()
            ram = " (--recall-ram counts for each session)" if self.recall is not None else ""
            raise UserError(
                f"--memory-budget {self.budget:,} bytes cannot hold the weights "
                f"({self.weights:,}) and one session ({need - self.weights:,}{ram}); "
                f"give at least {need:,}"
            )

    def stop(self) -> None:
        """Drain (see :meth:`drain`), then stop the worker."""
        self.scheduler.stop()
        self.sessions.close()  # the worker is gone: their stores close

    def drain(self) -> None:
        """Stop taking requests (refused from now on) and end the running ones at the
        worker's next round (a stream gets its end, cut short); :meth:`stop` then
        saves the resident sessions. Any thread, a signal handler included: it only
        sets a flag (a lock taken here could be held by the code it interrupted)."""
        self.scheduler.drain()

    def precheck(self, request: Request) -> None:
        """The worker's size check, run by the HTTP side on its own thread before the
        request is queued (a long prompt is slow to count: the worker serves
        the others meanwhile); :class:`TooLarge` over the limit. Without a fast
        tokenizer (not safe off the worker) the worker alone checks."""
        if self.planner.fast_core() is not None:
            try:
                self.planner.bound(request)
            except TooLarge:
                raise
            except Exception:  # noqa: BLE001 - the worker checks again and says why
                pass

    @property
    def max_prompt_tokens(self) -> int:
        """Most tokens one request may feed (refused over it)."""
        return self.planner.max_prompt_tokens

    @property
    def max_tokens_ceiling(self) -> int | None:
        """The operator's cap on any request's ``max_tokens``."""
        return self.planner.max_tokens_ceiling

    # ----- the worker's, delegated ----------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a generation request (any thread)."""
        self.scheduler.submit(request)

    def call(self, fn: Any):
        """Run ``fn`` on the worker thread; returns a ``concurrent.futures.Future``."""
        return self.scheduler.call(fn)

    def follow(self) -> None:
        """A follower rank: run rank 0's requests until rank 0 stops."""
        self.scheduler.follow()

    def make_batch(self) -> None:
        """The batch every session decodes in, or the reason there is none."""
        self.scheduler.make_batch()

    def publish(self) -> None:
        """Refresh :attr:`stats` (read by other threads without locking); on the
        worker thread (:meth:`call`)."""
        self.scheduler.publish()

    @property
    def running(self) -> int:
        """Requests running now; read on the worker thread."""
        return self.scheduler.running

    @property
    def current_batch(self) -> Any:
        """The batch every session decodes in (``None``: each decodes alone)."""
        return self.scheduler.current_batch

    @property
    def batch_refusal(self) -> str | None:
        """Why sessions do not decode in one batch (``None``: they do)."""
        return self.scheduler.batch_refusal

    # ----- the session table's, delegated ---------------------------------------------

    entries = property(lambda self: self.sessions.entries, doc="Sessions by (owner, id).")
    admission = property(lambda self: self.sessions.admission, doc="The byte budget.")
    store = property(lambda self: self.sessions.store, doc="The state folder.")
    snapshots = property(lambda self: self.sessions.snapshots, doc="Shared system prompts.")
    weights = property(lambda self: self.sessions.weights, doc="Bytes of the weights.")
    recall = property(lambda self: self.sessions.recall, doc="The recall tier's spec.")
    pin = property(lambda self: self.sessions.pin, doc="Most system-prompt tokens as sinks.")
    keep_system = property(lambda self: self.sessions.keep_system)
    evictions = property(lambda self: self.sessions.evictions, doc="Sessions saved to disk.")
    restores = property(lambda self: self.sessions.restores, doc="Sessions loaded back.")
    dropped = property(lambda self: self.sessions.dropped, doc="Caches dropped (rebuilt).")
    refusals = property(lambda self: self.scheduler.refusals, doc="Requests refused busy.")

    @property
    def budget(self) -> int:
        """The memory budget in bytes (settable)."""
        return self.sessions.budget

    @budget.setter
    def budget(self, value: int) -> None:
        self.sessions.budget = value

    def session_bytes(self, sinks: int) -> int:
        """Bytes of one resident session with ``sinks`` sinks (caches and checkpoint)."""
        return self.sessions.session_bytes(sinks)

    def used_bytes(self) -> int:
        """Weights + snapshots + resident sessions."""
        return self.sessions.used_bytes()

    def measure_cache(self, sinks: int) -> int:
        """Bytes of one session's caches with ``sinks`` sinks, measured."""
        return self.sessions.measure_cache(sinks)

    def store_config(self) -> dict[str, Any]:
        """What saved caches depend on (:meth:`Sessions.store_config`)."""
        return self.sessions.store_config()

    def evict(self, entry: Entry) -> Path | None:
        """Save ``entry``'s idle session to the state folder now; on the worker thread."""
        return self.sessions.evict(entry)

    def drop(self, entry: Entry) -> None:
        """Forget ``entry``: its caches released, its saved files removed."""
        self.sessions.drop(entry)

    def sinks_for(self, system: str | None) -> int:
        """The sinks a new session with the system prompt ``system`` gets."""
        return self.sessions.sinks_for(system)

    # ----- requests -------------------------------------------------------------------

    def _admit(self, origin: Request) -> None:
        """Start the caller's request ``origin`` (which learns the stop string that ended
        it), bounded by the planner, on its session; on the worker thread."""
        request = self.planner.bound(origin)
        if request.messages is None:
            self._admit_completion(request, origin)
            return
        planned = self.planner.plan(request)
        request, toolset, extra = planned.request, planned.toolset, planned.extra
        system, history, user = split_messages(request.messages)
        sessions = self.sessions
        entry, mode, repaired = sessions.place(request, toolset, system, history, user)
        note = f"edit rebuilt, not repaired: {repaired}" if isinstance(repaired, str) else None
        resumed = repaired if isinstance(repaired, marks.Resumed) else None
        repaired = None if note or resumed else repaired
        note = note or getattr(resumed or repaired, "note", None)
        session = entry.session
        head = sessions.unfed_head(session)
        if head and self.recall is None and head in self.snapshots:
            sessions.restore_head(session, head)  # a fork or rebuild of a shared prompt
            head = ""
        # with an unfed head: the head too
        turn = resumed.turn if resumed is not None else session.turn_tokens(user)
        if isinstance(request.emit, ThinkStream):
            request.emit.prompt(turn[1])  # a thought the prompt opened
        if len(turn[0]) > self.max_prompt_tokens:
            if mode in ("rebuild", "new"):  # its caches would not encode its transcript
                sessions.drop(entry)
            raise TooLarge(
                f"the prompt has {len(turn[0]):,} tokens to feed; this server takes at most "
                f"{self.max_prompt_tokens:,} per request (--max-prompt-tokens)"
            )
        cached = cache_count(session.caches)
        box: list = []
        if self.recall is None:  # marks: see serve.marks
            if entry.marks.spill is None and not entry.transient:  # where its base goes
                entry.marks.spill = self.store.path(entry.owner, entry.id)
            fed = functools.partial(marks.take, entry.marks, session, user, None if head else turn)
            extra = {**extra, "state": DecodeState(on_prompt_fed=fed)}
        tokens = session.stream(
            user, turn=None if head else turn, max_tokens=request.max_tokens,
            temp=request.temp, top_p=request.top_p, stop=request.stop, seed=request.seed,
            steps=self.scheduler.steps(request, box), **extra,
        )  # fmt: skip
        prefilled, entry.prefilled = min(entry.prefilled, cached), 0  # computed, not cached
        job = self.scheduler.start_job(request, entry, tokens, cached - prefilled, note)
        job.prompt, job.repaired, job.origin = len(turn[0]), repaired, origin
        job.head += prefilled
        if head:
            job.tokens = sessions.head_first(job, session, head, tokens)
        box.append(job)

    def _admit_completion(self, request: Request, origin: Request) -> None:
        """Start a plain completion on a transient session of its own."""
        sessions = self.sessions
        entry = Entry(
            id="completion-" + sessions.new_id(12), system=None, transient=True,
            owner=request.owner,
        )  # fmt: skip
        sessions.add(entry)
        try:
            self.admission.make_room(self.admission.single_bytes(self.settings.cache.sinks), entry)
            settings = sessions.settings_for(keep_system=False)
            session = ChatSession(
                self.model, self.tokenizer, settings, draft_model=self.draft_model
            )
        except BaseException:
            self.drop(entry)
            raise
        entry.session, entry.bytes = session, self.admission.single_bytes(session.sinks)
        tokens = list(self.tokenizer.encode(clean_text(request.prompt or "")))
        if not tokens:
            self.drop(entry)
            raise BadRequest("prompt: must not be empty")
        box: list = []
        try:
            planned = self.planner.plan(request)
        except BaseException:
            self.drop(entry)
            raise
        request = planned.request
        steps = self.scheduler.steps(request, box)
        generator = self._completion(session, tokens, request, steps, planned.extra)
        job = self.scheduler.start_job(request, entry, generator, 0)
        job.prompt, job.origin = len(tokens), origin
        box.append(job)

    @staticmethod
    def _completion(
        session: ChatSession, tokens: list[int], request: Request, steps: Any = None,
        extra: dict | None = None,
    ) -> Iterator[Any]:  # fmt: skip
        """A plain completion of ``tokens`` on ``session``'s caches; sets ``session.last``."""
        generator = session.generate(
            tokens, max_tokens=request.max_tokens, temp=request.temp, top_p=request.top_p,
            stop=request.stop, seed=request.seed, steps=steps, **(extra or {}),
        )  # fmt: skip
        last, generated = None, 0
        try:
            for response in generator:
                if response is not None:  # None: polled during the prefill
                    last, generated = response, generated + 1
                yield response
        finally:
            generator.close()
            session.last = Reply(
                text="",
                tokens=generated,
                tps=float(getattr(last, "generation_tps", 0.0) or 0.0),
                prompt_tokens=len(tokens),
                finish_reason=getattr(last, "finish_reason", None),
            )

    # ----- inspection -------------------------------------------------------------------

    def _refresh(self) -> None:
        """Build :attr:`stats` (the scheduler's :meth:`~Scheduler.publish`)."""
        import mlx.core as mx

        now = self.scheduler.published
        sessions = []
        totals = dict.fromkeys(recalled.TOTALS, 0)
        for e in self.entries.values():
            held = recalled.stats(e.session)  # zeros for a session on disk
            if e.session is not None and not held["device_bytes"] and e.busy:
                # decoding in the batch, its rows live in the batch's buffers: the bytes
                # of its full cache (what its own buffers hold between turns)
                spec = self.settings.cache_spec(e.sinks, drafting=self.draft_model is not None)
                held["device_bytes"] = spec.bytes(self.model)
            for k in totals:
                totals[k] += held[k]
            if e.transient:
                continue
            seen = cache_count(e.session.caches) if e.session else e.tokens_seen
            window = self.settings.cache.window
            sessions.append(
                {
                    "id": e.id,
                    "owner": e.owner,
                    "resident": e.session is not None,
                    "turns": len(e.messages) // 2,
                    "tokens_seen": seen,
                    "tokens_evicted": max(0, seen - e.sinks - window),
                    "sinks": e.sinks,
                    "window": window,
                    "cache": self.settings.cache_spec(
                        e.sinks, drafting=self.draft_model is not None
                    ).to_json(),
                    "cache_bytes": e.bytes if e.session else 0,
                    # flat: caches + recall region; growing: the recall store (RAM, disk)
                    **held,
                    "idle_s": round(now - e.last_used, 3),
                    "busy": e.busy,
                }
            )
        recall = None
        if self.recall is not None:
            recall = {**recalled.config(self.recall), "folder": self.recall.folder,
                      "ram_bytes_per_session": self.recall.ram_bytes}  # fmt: skip
        batch = self.scheduler.current_batch
        self.stats = {
            "sessions": sessions,
            "memory": {
                "budget_bytes": self.budget,
                "used_bytes": self.used_bytes(),
                "weights_bytes": self.weights,
                "session_bytes": self.admission.bytes_by_sinks.get(self.settings.cache.sinks),
                "snapshots": len(self.snapshots),
                "mlx_active_bytes": mx.get_active_memory(),
                "mlx_cache_bytes": mx.get_cache_memory(),
                **totals,  # over every resident session: device (flat) and store (growing)
                "recall": recall,
            },
            "batch": {
                "enabled": batch is not None,
                "reason": self.batch_refusal,
                "rows": len(batch.rows) if batch is not None else 0,
                "steps": batch.steps if batch is not None else 0,
            },
            "counters": {
                "evictions": self.evictions,
                "restores": self.restores,
                "refusals": self.refusals,
                "dropped": self.dropped,
                "active": self.scheduler.running,
            },
            "prefix_store": self._prefix_stats(),
        }

    def _prefix_stats(self) -> dict[str, Any] | None:
        """The prefix store's folder and counters (``None`` without one)."""
        p = self.sessions.prefixes
        if p is None:
            return None
        return {"folder": str(p.root), "enabled": p.enabled, "max_bytes": p.max_bytes,
                "hits": p.hits, "misses": p.misses, "writes": p.writes,
                "rejected": p.rejected}  # fmt: skip
