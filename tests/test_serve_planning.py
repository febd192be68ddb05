"""A request planned for the serve worker is a new object: the caller's request keeps
what it was built with; the copy has the server's defaults, bounds and the messages in
the engine's shape. Each refusal maps to one HTTP status, known only above the engine."""

from __future__ import annotations

import pytest

from mlx_stream.cache import CacheSpec
from mlx_stream.generate.model_config import Sampling
from mlx_stream.generate.session import Settings


def planner(loaded, **kw):
    from mlx_stream.serve.planning import Planner

    _, tokenizer = loaded
    settings = Settings(CacheSpec(sinks=2, window=64), max_tokens=40)
    limits = {"max_prompt_tokens": 1000, "max_tokens_ceiling": None, **kw}
    return Planner(tokenizer, Sampling(temp=0.7, top_p=0.9), settings, draft=False, **limits)


def test_planning_returns_a_new_request_and_leaves_the_callers_alone(loaded):
    from mlx_stream.serve.engine import Request

    messages = [{"role": "user", "content": "hi", "name": "ann"}]
    request = Request(emit=print, messages=messages)
    bounded = planner(loaded, max_tokens_ceiling=30).bound(request)
    planned = planner(loaded).plan(bounded)
    assert bounded is not request and planned.request is not bounded
    assert request.max_tokens is None and bounded.max_tokens == 30
    assert request.messages is messages and messages[0]["name"] == "ann"
    assert planned.request.messages == [{"role": "user", "content": "hi"}]
    assert (request.temp, request.top_p) == (None, None)
    assert (planned.request.temp, planned.request.top_p) == (0.7, 0.9)
    assert planned.request.cancelled is request.cancelled  # a cancel still reaches it
    assert planned.plan is None and planned.toolset is None


def test_a_new_message_over_the_prompt_limit_is_too_large(loaded):
    from mlx_stream.serve.engine import Request, TooLarge

    request = Request(emit=print, messages=[{"role": "user", "content": "word " * 50}])
    with pytest.raises(TooLarge, match="at most 10 per request"):
        planner(loaded, max_prompt_tokens=10).bound(request)


def test_each_refusal_maps_to_its_status():
    from mlx_stream.errors import RuntimeFailure, UserError
    from mlx_stream.serve.event_types import Failed
    from mlx_stream.serve.refusals import BadRequest, Busy, ShuttingDown, TooLarge, Unsaved
    from mlx_stream.serve.statuses import status_of

    assert status_of(Failed(Busy("full", retry_after=3))) == (429, "full", 3)
    assert status_of(Failed(Unsaved("disk"))) == (507, "disk", None)
    assert status_of(Failed(RuntimeFailure("save"))) == (500, "save", None)
    assert status_of(Failed(TooLarge("big"))) == (413, "big", None)
    assert status_of(Failed(BadRequest("bad"))) == (400, "bad", None)
    assert status_of(Failed(UserError("bad"))) == (400, "bad", None)
    assert status_of(Failed(KeyError("x"))) == (500, "KeyError: 'x'", None)
    assert status_of(Failed(ShuttingDown())) == (503, "the server is shutting down", None)
    # raised while the request ran: the server's fault, whatever the exception
    assert status_of(Failed(UserError("bad"), crashed=True)) == (500, "UserError: bad", None)


@pytest.mark.parametrize(
    "part",
    ["engine", "scheduler", "sessions", "admission", "store", "matching", "planning",
     "marks", "refusals", "event_types"],
)  # fmt: skip
def test_below_the_routes_nothing_knows_a_status(part):
    """The status table is the HTTP side's: the engine's parts never import it (a
    failure reaches the routes as the exception a ``Failed`` event carries)."""
    import ast

    from tests.support.paths import REPO

    tree = ast.parse((REPO / "mlx_stream" / "serve" / f"{part}.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names |= {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    assert not {"mlx_stream.serve.statuses", "mlx_stream.serve.app"} & names
