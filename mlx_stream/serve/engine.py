"""The engine of ``mlx-stream serve``: chat sessions in fixed memory, admitted by bytes,
all model work on one MLX thread.

Contract: :class:`Engine` composes its parts, one concern each: the worker and its
rounds (:mod:`~mlx_stream.serve.scheduler`), the sessions' lifecycle
(:mod:`~mlx_stream.serve.sessions`), a request planned as a new object
(:mod:`~mlx_stream.serve.planning`), the byte budget (:mod:`~mlx_stream.serve.admission`),
the state folder (:mod:`~mlx_stream.serve.store`), which session a request continues
(:mod:`~mlx_stream.serve.matching`). It owns admitting a request and the stats; it
re-exports the names the HTTP side imports. The design: ``docs/serve.md``.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlx_stream.defaults import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_PIN_TOKENS
from mlx_stream.errors import UserError
from mlx_stream.generate.session import ChatSession, Reply, Settings, cache_count, clean_text
from mlx_stream.generate.steps import DecodeState
from mlx_stream.serve import marks
from mlx_stream.serve import recall as recalled
from mlx_stream.serve.admission import COPIES, Admission, weights_bytes
from mlx_stream.serve.event_types import Started
from mlx_stream.serve.logprobs import TokenLogprobs
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
from mlx_stream.serve.scheduler import DEFAULT_CHUNK, Job, Request, Scheduler
from mlx_stream.serve.sessions import Sessions
from mlx_stream.serve.store import SessionStore


class Engine(Scheduler, Sessions):
    """Sessions and the one MLX worker thread that runs them, admitted by bytes
    (:class:`~mlx_stream.serve.admission.Admission`), saved to the state folder
    (:class:`~mlx_stream.serve.store.SessionStore`).

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
        max_prompt_tokens (int): Most tokens one request may feed (HTTP 413 over it).
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
    ):
        from mlx_stream.generate.model_config import Sampling

        self.model, self.tokenizer, self.draft_model = model, tokenizer, draft_model
        self.sampling = sampling if sampling is not None else Sampling()  # greedy
        self.prefixes, self.repair_tokens = prefix_store, repair_tokens
        self.planner = Planner(
            tokenizer, self.sampling, settings, draft=draft_model is not None,
            max_prompt_tokens=max_prompt_tokens, max_tokens_ceiling=max_tokens_ceiling,
        )  # fmt: skip
        self.pin = min(DEFAULT_PIN_TOKENS, settings.cache.window) if pin is None else pin
        self._closing = False  # draining: requests are refused (503)
        self._logprobs = TokenLogprobs(tokenizer)
        self._eos = set(getattr(tokenizer, "eos_token_ids", ()) or ()) | set(settings.stop_tokens)
        self.cluster, self._ids = cluster, None
        if cluster is not None:
            self._ids = random.Random(cluster.share_int(random.getrandbits(62)))
            if state_dir is not None:  # ranks on one machine must not share files
                state_dir = Path(state_dir) / f"rank-{cluster.rank}"
                state_dir.mkdir(exist_ok=True)
        self.settings, self.model_id, self.keep_system = settings, model_id, keep_system
        weights = weights_bytes(model) + (weights_bytes(draft_model) if draft_model else 0)
        self.chunk, self.isolate = chunk, isolate
        self.recall = settings.cache.recall  # a RecallSpec: each session its own store
        recalled.remove_stale(self.recall)
        self.store = SessionStore(state_dir, self.store_config)
        self.entries: dict[tuple[str, str], Entry] = {}  # by (owner, id)
        self.admission = Admission(
            self.entries, weights, budget, max_sessions, measure=self.measure_cache, evict=self._evict,
            fixed=lambda sinks: recalled.fixed_bytes(model, self.recall, sinks),
            copies=2 if self.recall is not None else COPIES,  # marks only without recall
        )  # fmt: skip
        self._dropped: set[tuple[str, str]] = set()  # caches dropped: rebuilt on next use
        self._active: list[Job] = []
        self._init_worker()
        self.stats: dict[str, Any] = {}
        self._published = 0.0
        self.evictions = self.restores = self.refusals = self.dropped = 0
        self.batching, self._batch, self.batch_refusal = batching, None, "off (--no-batch)"
        if cluster is not None:
            self.batching = False
            self.batch_refusal = "off (--distributed: one request at a time, on every rank)"

    # ----- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker; measure a session's bytes first and refuse a budget
        that cannot hold the weights and one session. Sessions the state folder's
        index lists (and whose files are intact) are found again."""
        for entry in self.store.load(discard=self.cluster is not None):
            self.entries[entry.key] = entry  # on disk: loaded on its next request
        self._start_worker()
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
        self._closing = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._stopping = True
        for entry in self.entries.values():  # the worker is gone: their stores close
            recalled.release(entry.session)
        self.store.cleanup()

    def drain(self) -> None:
        """Stop taking requests (503 from now on) and end the running ones at the
        worker's next round (a stream gets its end, cut short); :meth:`stop` then
        saves the resident sessions. Any thread, a signal handler included: it only
        sets a flag (a lock taken here could be held by the code it interrupted)."""
        self._closing = True

    def precheck(self, request: Request) -> None:
        """The worker's size check, run by the HTTP side on its own thread before the
        request is queued (a 4 MB prompt takes seconds to count: the worker serves
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
        """Most tokens one request may feed (HTTP 413 over it)."""
        return self.planner.max_prompt_tokens

    @property
    def max_tokens_ceiling(self) -> int | None:
        """The operator's cap on any request's ``max_tokens``."""
        return self.planner.max_tokens_ceiling

    # ----- requests -------------------------------------------------------------------

    def _admit(self, request: Request, origin: Request | None = None) -> None:
        """Start ``request`` (bounded by the planner; ``origin``: the caller's, which
        learns the stop string that ended it) on its session."""
        if request.messages is None:
            self._admit_completion(request, origin)
            return
        planned = self.planner.plan(request)
        request, toolset, extra = planned.request, planned.toolset, planned.extra
        system, history, user = split_messages(request.messages)
        entry, mode, repaired = self._place(request, toolset, system, history, user)
        note = f"edit rebuilt, not repaired: {repaired}" if isinstance(repaired, str) else None
        resumed = repaired if isinstance(repaired, marks.Resumed) else None
        repaired = None if note or resumed else repaired
        note = note or getattr(resumed or repaired, "note", None)
        session = entry.session
        head = self._unfed_head(session)
        if head and self.recall is None and head in self.admission.snapshots:
            self._restore_head(session, head)  # a fork or rebuild of a shared prompt
            head = ""
        # with an unfed head: the head too
        turn = resumed.turn if resumed is not None else session.turn_tokens(user)
        if isinstance(request.emit, ThinkStream):
            request.emit.prompt(turn[1])  # a thought the prompt opened
        if len(turn[0]) > self.max_prompt_tokens:
            if mode in ("rebuild", "new"):  # its caches would not encode its transcript
                self.drop(entry)
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
            steps=self._steps(request, box), **extra,
        )  # fmt: skip
        prefilled, entry.prefilled = min(entry.prefilled, cached), 0  # computed, not cached
        job = self._start(request, entry, tokens, cached - prefilled, self._batch is not None, note)
        job.prompt, job.repaired, job.origin = len(turn[0]), repaired, origin
        job.head += prefilled
        if head:
            job.tokens = self._head_first(job, session, head, tokens)
        box.append(job)

    def _admit_completion(self, request: Request, origin: Request | None = None) -> None:
        entry = Entry(
            id="completion-" + self._new_id(12), system=None, transient=True, owner=request.owner
        )
        self._add(entry)
        try:
            self.admission.make_room(self.admission.single_bytes(self.settings.cache.sinks), entry)
            settings = self._settings(keep_system=False)
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
        steps = self._steps(request, box)
        generator = self._completion(session, tokens, request, steps, planned.extra)
        job = self._start(request, entry, generator, 0, batched=self._batch is not None)
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

    def _start(
        self, request: Request, entry: Entry, tokens: Iterator[Any], cached: int, batched: bool,
        note: str | None = None,
    ) -> Job:  # fmt: skip
        """Run ``request``'s ``tokens``; its start event carries ``note`` for the log."""
        entry.busy = True
        entry.last_used = time.monotonic()
        job = Job(request, entry, tokens, cached, batched=batched)
        self._active.append(job)
        request.emit(Started(None if entry.transient else entry.id, note))
        return job

    # ----- inspection -------------------------------------------------------------------

    def publish(self) -> None:
        """Refresh :attr:`stats` (read by other threads without locking); on the
        worker thread (:meth:`call`)."""
        import mlx.core as mx

        now = self._published = time.monotonic()
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
                "enabled": self._batch is not None,
                "reason": self.batch_refusal,
                "rows": len(self._batch.rows) if self._batch is not None else 0,
                "steps": self._batch.steps if self._batch is not None else 0,
            },
            "counters": {
                "evictions": self.evictions,
                "restores": self.restores,
                "refusals": self.refusals,
                "dropped": self.dropped,
                "active": len(self._active),
            },
            "prefix_store": self._prefix_stats(),
        }

    def _prefix_stats(self) -> dict[str, Any] | None:
        """The prefix store's folder and counters (``None`` without one)."""
        p = self.prefixes
        if p is None:
            return None
        return {"folder": str(p.root), "enabled": p.enabled, "max_bytes": p.max_bytes,
                "hits": p.hits, "misses": p.misses, "writes": p.writes,
                "rejected": p.rejected}  # fmt: skip
