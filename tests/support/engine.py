"""In-process serve engines for tests: made, asked and run on their worker thread."""

from __future__ import annotations

import queue

from mlx_stream.generate.session import Settings
from mlx_stream.serve.event_types import Delta, End, Failed
from mlx_stream.serve.statuses import status_of


def make_engine(loaded, state_dir, settings=None, **kw):
    from mlx_stream.cache import CacheSpec
    from mlx_stream.serve.engine import Engine

    model, tokenizer = loaded
    given = {"sinks": 2, "window": 64, "max_tokens": 40, **(settings or {})}
    quant = {k: given.pop(k) for k in ("kv_bits", "key_bits", "kv_group_size") if k in given}
    cache = CacheSpec(sinks=given.pop("sinks"), window=given.pop("window"), **quant)
    settings = Settings(cache, **given)
    e = Engine(model, tokenizer, settings, "tiny", state_dir=state_dir, **kw)
    e.start()
    return e


def refused(event: Failed) -> tuple:
    """A failed request as the HTTP side answers it: ``("error", status, message,
    retry_after)`` (:func:`~mlx_stream.serve.statuses.status_of`)."""
    return ("error", *status_of(event))


def ask(engine, messages, timeout=120, **kw):
    """One request to the end: ``(text, usage or None, error or None)``; the error as
    :func:`refused` gives it."""
    from mlx_stream.serve.engine import Request

    box: queue.Queue = queue.Queue()
    engine.submit(Request(emit=box.put, messages=messages, **kw))
    parts = []
    while not isinstance(event := box.get(timeout=timeout), (End, Failed)):
        if isinstance(event, Delta):
            parts.append(event.text)
    if isinstance(event, Failed):
        return None, None, refused(event)
    return "".join(parts), event.usage, None


def on_worker(engine, fn):
    return engine.call(fn).result(timeout=120)


def ask_turn(engine, messages, session_id=None, **kw):
    """Submit one chat request and wait for its events: (text, usage) or an error."""
    from mlx_stream.serve.engine import Request

    events: queue.Queue = queue.Queue()
    engine.submit(Request(emit=events.put, messages=messages, session_id=session_id, **kw))
    text = []
    while True:
        match events.get(timeout=60):
            case Delta(piece):
                text.append(piece)
            case End(usage):
                return "".join(text), usage
            case Failed() as event:
                return None, refused(event)
