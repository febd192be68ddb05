"""Serving: the OpenAI-compatible server behind ``mlx-stream serve``.

Lives here: the engine (``engine``, owning ``scheduler``: the worker thread and its
rounds, ``sessions``: the session table; ``planning``: a request planned as a new object,
``admission``: the byte budget, ``store``: the state folder, ``matching``: which session
a request continues, ``refusals``: the errors, ``event_types``: what a request is sent;
``models``: several models, an engine each, loaded on first use),
the HTTP routes (``app``: FastAPI, ``statuses``: the status of each refusal) and token logprobs (``logprobs``); for agents, per-request
sampling (``sampling``), llguidance constraints (``structured``), tool calls
(``tools``) and the other APIs' translations into the engine's one request type (``anthropic``: Messages API, ``responses``: Responses API;
``fields``, ``events``: what they share).

May import: ``generate``, ``cache``, ``models``, ``distributed`` and the package's
base modules; nothing imports it but the CLI. Never typer or rich
(``tests/test_layering.py`` checks).
"""
