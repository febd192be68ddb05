"""``mlx-stream serve``: an OpenAI-compatible server where every session lives in fixed
memory (the engine is :mod:`mlx_stream.serve.engine`, the routes :mod:`mlx_stream.serve.app`)."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Annotated

import typer

from mlx_stream.defaults import (
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_MAX_TOKENS_CEILING,
    DEFAULT_REPAIR_TOKENS,
    DEFAULT_SERVE_MAX_TOKENS,
    DEFAULT_STOP_LOOPS,
    LOOP_REPEATS,
)

from . import options as opt
from .common import (
    check_positive,
    fail,
    handle_errors,
    stderr_console,
)
from .groups import Only, grouped

# serve's own help panels, after its common options and the shared groups
SESSIONS, REQUESTS, ACCESS, CONNECTIONS = "Sessions", "Requests", "Access", "Connections"
MODELS = "Several models"

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10,
         "mib": 1 << 20, "gib": 1 << 30}  # fmt: skip

Host = Annotated[str, typer.Option(help="Address to listen on (127.0.0.1: this machine only).")]
Port = Annotated[int, typer.Option(help="TCP port.")]
MemoryBudget = Annotated[
    str,
    typer.Option(
        "--memory-budget",
        help="Bytes for weights + sessions (e.g. 2GB, 512MiB), or 'auto' (the weights and 8 "
        "sessions at the full window, at most 75% of memory). A session that does not fit "
        "evicts an idle one to disk, or gets 429.",
        rich_help_panel=SESSIONS,
    ),
]
MaxSessions = Annotated[
    int | None,
    typer.Option(
        "--max-sessions", help="Most sessions kept in memory at once.", rich_help_panel=SESSIONS
    ),
]
KeepSystem = Annotated[
    bool,
    typer.Option(
        "--keep-system/--no-keep-system",
        help="Pin each session's rendered system prompt as its sinks (shared prefill).",
    ),
]
Batching = Annotated[
    bool,
    typer.Option(
        "--batch/--no-batch",
        help="Decode all sessions together, one batched model call per step.",
    ),
]
ApiKey = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="MLX_STREAM_API_KEY",
        show_envvar=True,
        help="Require 'Authorization: Bearer KEY' on every route but /health (OpenAI "
        "clients send their api_key so). Default: none (anyone who can reach the port may "
        "use it).",
        rich_help_panel=ACCESS,
    ),
]
ApiKeys = Annotated[
    Path | None,
    typer.Option(
        "--api-keys",
        help="A file of API keys, one per line ('#' comments): each key has its own "
        "sessions, and sees and continues only those.",
        rich_help_panel=ACCESS,
    ),
]
Isolate = Annotated[
    bool,
    typer.Option(
        "--isolate",
        help="Never match a request without X-Session-ID to an existing session by its "
        "transcript (for one key shared by several people).",
        rich_help_panel=ACCESS,
    ),
]
StateDir = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        help="Where evicted sessions are saved, and every resident one on exit (SIGTERM): "
        "a restart with the same folder continues them. Default: a temp folder.",
        rich_help_panel=SESSIONS,
    ),
]
RepairTokens = Annotated[
    int,
    typer.Option(
        "--repair-tokens",
        help="After an edit in the middle of a conversation (an old tool result shortened, "
        "a message rewritten), keep the KV before it, compute the edit and this many tokens "
        "after it again, and reuse the rest moved into place (approximate; a number "
        "covering the window is exact). 0: rebuild from the system prompt as before.",
        rich_help_panel=SESSIONS,
    ),
]
StopLoops = Annotated[
    int,
    typer.Option(
        "--stop-loops",
        help="End a reply whose last this-many tokens repeat one span at least 4 times "
        "(a small model's loop would run to max_tokens, and an agent takes a reply cut "
        "there as a failed turn); the reply ends as a finished one. 0: never.",
        rich_help_panel=REQUESTS,
    ),
]
NoUi = Annotated[
    bool,
    typer.Option("--no-ui", help="No chat page at / (the APIs only; HEAD / still answers)."),
]
Quiet = Annotated[
    bool,
    typer.Option("--quiet", help="No access log: one line per request on stderr otherwise."),
]
ServeWindow = Annotated[
    int | None,
    typer.Option(
        help="Recent tokens kept in the rolling window. Default: the model's trained context "
        "less the pinned system prompt, cut to what the memory budget holds for 4 sessions.",
    ),
]
ServeMaxTokens = Annotated[
    int,
    typer.Option(
        "--max-tokens",
        help="Most tokens generated per reply when a request sets no max_tokens of its own.",
    ),
]
MaxTokensCeiling = Annotated[
    int | None,
    typer.Option(
        "--max-tokens-ceiling",
        help="Cap every request's max_tokens at this (said in the X-Max-Tokens-Ceiling "
        "response header and the log); 0: no cap.",
        rich_help_panel=REQUESTS,
    ),
]
CorsOrigin = Annotated[
    list[str] | None,
    typer.Option(
        "--cors-origin",
        metavar="ORIGIN",
        help="A web page's origin (https://app.example:3000) that may call this server "
        "from a browser (repeatable; '*': any site, which lets every page you open use "
        "it). Default: only the chat page served here.",
        rich_help_panel=ACCESS,
    ),
]
AllowedHost = Annotated[
    list[str] | None,
    typer.Option(
        "--allowed-host",
        metavar="NAME",
        help="A Host name requests may be sent to besides 127.0.0.1, localhost, [::1] and "
        "--host (repeatable; '*': any). Others get 421 (DNS rebinding).",
        rich_help_panel=ACCESS,
    ),
]
MaxConnections = Annotated[
    int,
    typer.Option(
        "--max-connections",
        help="Most open connections; one more closes the oldest that has not sent its "
        "headers, or gets 503 when all are busy.",
        rich_help_panel=CONNECTIONS,
    ),
]
HeaderTimeout = Annotated[
    float,
    typer.Option(
        "--header-timeout",
        help="Seconds a connection has to send a request's line and headers.",
        rich_help_panel=CONNECTIONS,
    ),
]
MaxPromptTokens = Annotated[
    int,
    typer.Option(
        "--max-prompt-tokens",
        help="Most tokens one request may feed (a new session's whole history, else its new "
        "messages); more is refused with 413. A long prompt goes in a chunk at a time "
        "between other requests' tokens, through the window like any other stream.",
        rich_help_panel=REQUESTS,
    ),
]


AddModel = Annotated[
    list[str] | None,
    typer.Option(
        "--add-model",
        metavar="MODEL",
        help="Another model a request's 'model' may name, listed in /v1/models and loaded "
        "on first use (a registry name, Hugging Face id, folder or .gguf, as -m takes; "
        "repeatable). A request may also name any pulled registry model or Hugging Face "
        "id in the local caches. Each model has its own sessions, saved to its own "
        "subfolder of --state-dir when it is unloaded.",
        rich_help_panel=MODELS,
    ),
]
KeepAlive = Annotated[
    str,
    typer.Option(
        "--keep-alive",
        help="How long a model stays loaded after its last request (ollama's: 5m, 1h, "
        "30s; 0: unloaded right after; -1: until the memory budget needs its room). A "
        "request's keep_alive (ollama's API) sets it for its model.",
        rich_help_panel=MODELS,
    ),
]


def parse_keep_alive_flag(text: str) -> float | None:
    """``--keep-alive`` in seconds (``None``: forever); else a one-line error."""
    from mlx_stream.errors import UserError
    from mlx_stream.serve.models import parse_keep_alive

    try:
        return parse_keep_alive(text)
    except UserError:
        fail(f"--keep-alive must be a duration like 5m, 1h, 30s, 0 or -1 (got {text!r})")


def served_id(name: str) -> str:
    """The id a model given on the command line is served under before it is loaded
    (a folder's or file's name; a registry name or Hugging Face id as given)."""
    path = Path(name).expanduser()
    return path.name if path.exists() else name


def check_listen(host: str, port: int) -> None:
    """One-line error, before the model loads, unless ``host:port`` can be listened on."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            sock.bind((host, port))
    except OSError as exc:
        fail(f"cannot listen on {host}:{port} ({exc.strerror or exc})")


def parse_bytes(text: str) -> int | None:
    """``"2GB"`` -> 2_000_000_000; ``"auto"`` -> None; else a one-line error."""
    if text.strip().lower() == "auto":
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS or float(match.group(1)) <= 0:
        fail(f"--memory-budget must be a size like 2GB, 512MiB or 'auto' (got {text!r})")
    return int(float(match.group(1)) * UNITS[unit])


def sampling_note(sample) -> str:
    """A request's sampling when it gives no temperature, in a few words."""
    if sample.temp == 0:
        words = "greedy"
    else:
        words = f"temperature {sample.temp:g}, top-p {sample.top_p:g}"
        words += f", top-k {sample.top_k}" if sample.top_k else ""
    if sample.repetition_penalty not in (None, 1.0):
        words += f", repetition penalty {sample.repetition_penalty:g}"
    return words


def recall_note(policy) -> str:
    """The startup line's words on ``--recall``."""
    return (
        f"recall {policy.blocks} blocks, store {policy.ram_bytes / 1e6:,.0f} MB RAM per "
        "session then disk · "
    )


@dataclasses.dataclass(frozen=True)
class ServeCacheOptions(opt.CacheOptions):
    """The cache options with serve's ``--window`` (sized from the model and the budget)."""

    window: ServeWindow = None


@dataclasses.dataclass(frozen=True)
class ServeReplyOptions(opt.ReplyOptions):
    """The reply options with serve's ``--max-tokens`` (a request's default)."""

    max_tokens: ServeMaxTokens = DEFAULT_SERVE_MAX_TOKENS


@handle_errors
@grouped
def serve(
    host: Host = "127.0.0.1",
    port: Port = 8080,
    keep_system: KeepSystem = True,
    *,
    reply: Annotated[ServeReplyOptions, Only("max_tokens")],
    batch: Batching = True,
    quiet: Quiet = False,
    no_ui: NoUi = False,
    model: opt.ModelOptions,
    cache: ServeCacheOptions,
    sampling: Annotated[opt.SamplingOptions, Only("temp", "top_p", "top_k", "repetition_penalty")],
    draft: opt.DraftOptions,
    recall: opt.RecallOptions,
    prefix_store: opt.PrefixStoreOptions,
    memory_budget: MemoryBudget = "auto",
    max_sessions: MaxSessions = None,
    state_dir: StateDir = None,
    repair_tokens: RepairTokens = DEFAULT_REPAIR_TOKENS,
    max_tokens_ceiling: MaxTokensCeiling = DEFAULT_MAX_TOKENS_CEILING,
    max_prompt_tokens: MaxPromptTokens = DEFAULT_MAX_PROMPT_TOKENS,
    stop_loops: StopLoops = DEFAULT_STOP_LOOPS,
    api_key: ApiKey = None,
    api_keys: ApiKeys = None,
    isolate: Isolate = False,
    cors_origin: CorsOrigin = None,
    allowed_host: AllowedHost = None,
    max_connections: MaxConnections = DEFAULT_MAX_CONNECTIONS,
    header_timeout: HeaderTimeout = DEFAULT_HEADER_TIMEOUT,
    add_model: AddModel = None,
    keep_alive: KeepAlive = "-1",
) -> None:
    """Serve the OpenAI API (chat, completions, models, Responses) and Anthropic's
    Messages API with fixed memory per session: Claude Code and Codex run on it.

    Clients resend the whole conversation each turn; the server finds the session by
    its transcript (or an X-Session-ID header) and feeds only the new message. A prompt
    longer than the window is served: the first 1,024 tokens of a system prompt are
    pinned, the rest streams through the window. Memory is weights + sessions x a
    fixed size: a session that does not fit evicts an idle one to disk, and when none
    is idle the request gets 429 with Retry-After. One line per request on stderr
    (--quiet: none). SIGTERM ends running requests, saves the sessions to --state-dir
    and exits.

    A request's model picks the model (-m's for none): one given with --add-model, a
    pulled registry model or a Hugging Face id in the local caches is loaded on first
    use; --memory-budget counts every loaded model, and an idle one is unloaded (least
    recently used first, its sessions saved to its folder of --state-dir) when another
    needs the room or after --keep-alive.

    Under mlx.launch the model is sharded over the ranks: rank 0 serves HTTP and
    hands each request to the others (one request at a time, not batched).

    With --recall every session keeps its own store of what left its window (host
    memory up to --recall-ram per session, counted in --memory-budget; then disk, in
    its own subfolder of --recall-dir) and sessions decode alone, not batched.

    A system prompt's prefilled cache goes to the prefix store on disk (--prefix-store,
    shared with chat and other servers): a restarted server starts from it.

    A request that gives no temperature samples with the model's defaults (its
    generation_config.json, else temperature 0.7, top-p 0.9, top-k 40, repetition
    penalty 1.1; --temp and the other sampling options change them); one that gives a
    temperature gets exactly the sampling it asks for (0: greedy).
    """
    check_positive(reply.max_tokens, "--max-tokens")
    check_positive(max_tokens_ceiling, "--max-tokens-ceiling", 0)
    max_tokens_ceiling = max_tokens_ceiling or None
    check_positive(max_connections, "--max-connections")
    if not header_timeout > 0:
        fail(f"--header-timeout must be more than 0 seconds (got {header_timeout})")
    if stop_loops and stop_loops < LOOP_REPEATS:
        fail(f"--stop-loops must be 0 (off) or at least {LOOP_REPEATS} tokens, not {stop_loops}")
    check_positive(max_prompt_tokens, "--max-prompt-tokens")
    draft.check()
    check_positive(max_sessions, "--max-sessions")
    check_positive(port, "--port", 0)
    check_positive(repair_tokens, "--repair-tokens", 0)
    if port > 65535:
        fail(f"--port must be at most 65535 (got {port})")
    sampling.check()
    cache.check()
    budget = parse_bytes(memory_budget)
    recall_policy = recall.spec()
    prefixes = prefix_store.open()
    if api_key is not None and not api_key.strip():
        fail("--api-key must not be empty")
    from mlx_stream.serve.app import read_api_keys

    keys = ([api_key.strip()] if api_key is not None else []) + (
        read_api_keys(api_keys) if api_keys is not None else []
    )
    from mlx_stream.serve.guard import LOOPBACK, Browsers, host_name

    browsers = Browsers.make(host, allowed_host or (), cors_origin or (), keyed=bool(keys))
    if host_name(host) not in LOOPBACK and not keys:
        stderr_console().print(
            f"warning: --host {host} without --api-key: anyone who can reach this port "
            "may use the model and read its sessions (a Host other than this machine's "
            "loopback names or an --allowed-host gets 421)",
            style="yellow", highlight=False, soft_wrap=True,
        )  # fmt: skip
    if state_dir is not None and not state_dir.is_dir():
        fail(f"--state-dir {state_dir}: {'not a' if state_dir.exists() else 'no such'} directory")
    if state_dir is not None and not os.access(state_dir, os.W_OK | os.X_OK):
        fail(f"--state-dir {state_dir}: not writable")
    cluster = model.join()
    if cluster is not None:  # a rank's caches hold its shard only: no shared entries
        prefixes = None
    if cluster is not None and recall_policy is not None:
        fail("--recall is not available with --distributed")
    if cluster is None or cluster.is_root:
        check_listen(host, port)
    keep_alive_s = parse_keep_alive_flag(keep_alive)
    if add_model and cluster is not None:
        fail("--add-model is not available with --distributed (one model over the ranks)")
    root = state_dir
    scratch = None
    if state_dir is None and cluster is None:  # an unloaded model's sessions outlive it
        import tempfile

        scratch = tempfile.TemporaryDirectory(prefix="mlx-stream-sessions-")
        root = Path(scratch.name)

    def open_model(name: str | None, first: bool, budget: int | None, turns=None):
        """The model ``name`` loaded and its engine built, not started; the first
        model's budget is sized here (``auto``)."""
        from mlx_stream.generate.model_config import end_of_turn_tokens
        from mlx_stream.generate.session import Settings
        from mlx_stream.serve.admission import auto_budget, window_for
        from mlx_stream.serve.engine import Engine

        options = model if first else dataclasses.replace(model, model=name)
        target, tokenizer, spec, policy, path = options.load(cache, cluster)
        sample = sampling.sampling(path)
        store = prefixes if first else prefix_store.open()
        store = store and store.bind(path)  # entries keyed by the model's folder
        drafter = draft.load(model.dtype) if first else None  # the draft fits -m's tokenizer
        model_id = spec.name if spec is not None else Path(options.model or "default").name
        aliases: tuple[str, ...] = ()
        if spec is not None:
            from mlx_stream.models import hub, registry

            aliases = tuple(sorted(hub.aliases(spec, registry.load_registry()) - {model_id}))
        if cache.window is None:  # from the model's context and the budget, not the registry's
            context = getattr(spec, "context", None)
            policy = policy.replace(window=window_for(target, context, policy, budget))
        if budget is None and recall_policy is None and cluster is None:
            budget = auto_budget(target, policy)  # a few sessions, not the whole machine
        policy = policy.replace(recall=recall_policy)
        folder = root if first or root is None else root / model_id.replace("/", "--")
        if folder is not None:
            folder.mkdir(exist_ok=True)
        settings = Settings(cache=policy, max_tokens=reply.max_tokens,
                            num_draft_tokens=draft.num_draft_tokens,
                            stop_tokens=end_of_turn_tokens(tokenizer),
                            stop_loops=stop_loops)  # fmt: skip
        engine = Engine(
            target, tokenizer, settings, model_id, draft_model=drafter,
            keep_system=keep_system, budget=budget, max_sessions=max_sessions,
            state_dir=folder, batching=batch, cluster=cluster, isolate=isolate,
            max_prompt_tokens=max_prompt_tokens, max_tokens_ceiling=max_tokens_ceiling,
            prefix_store=store, sampling=sample, repair_tokens=repair_tokens, turns=turns,
        )  # fmt: skip
        return engine, aliases, policy, sample

    from mlx_stream.serve.models import Models, Turns, servable

    turns = Turns() if cluster is None else None
    engine, aliases, policy, sample = open_model(model.model, True, budget, turns)
    models = Models(engine, aliases)
    first_id = engine.model_id
    sources = {first_id: model.model or first_id}  # no -m: the registry's default
    for name in add_model or ():
        sources[served_id(name)] = sources[name] = name

    def find(name: str) -> str | None:
        return sources.get(name) or (name if servable(name) else None)

    def opener(name: str):
        # the first model again: its folder, its draft and its window as first sized
        again = name == sources[first_id]
        sized = budget if again else models.budget  # the same window: its saved sessions fit
        engine, aliases, _, _ = open_model(name, again, sized, turns)
        return engine, aliases

    import uvicorn

    engine.start()
    if cluster is not None and not cluster.is_root:
        engine.follow()  # until rank 0 stops
        return
    if cluster is None:
        models = Models(
            engine, aliases, opener=opener, find=find,
            offered=tuple(served_id(n) for n in add_model or ()), budget=engine.budget,
            keep_alive=keep_alive_s, turns=turns,
        )  # fmt: skip
        models.start()
    try:
        memory = engine.stats.get("memory", {})
        per = memory.get("session_bytes") or 0
        stderr_console().print(
            f"mlx-stream serve · {engine.model_id} · window {policy.window} · system prompts pinned "
            f"up to {engine.pin} tokens · "
            + (f"max_tokens ceiling {max_tokens_ceiling} · " if max_tokens_ceiling else "")
            + (f"{cluster.strategy} over {cluster.size} ranks · " if cluster else "")
            + (recall_note(recall_policy) if recall_policy is not None else "")
            + f"default sampling {sampling_note(sample)} · "
            + f"budget {engine.budget / 1e6:,.0f} MB (weights {engine.weights / 1e6:,.1f} MB, "
            f"{per / 1e6:,.2f} MB per session) · "
            + (f"not batched: {engine.batch_refusal} · " if engine.batch_refusal else "batched · ")
            + f"http://{host}:{port}/v1"
            + ("" if no_ui else f" · chat page http://{host}:{port}/"),
            style="dim",
            highlight=False,
            soft_wrap=True,
        )
        from mlx_stream.serve.app import create_app
        from mlx_stream.serve.transport import protocol

        app = create_app(models, api_keys=keys, quiet=quiet, ui=not no_ui,
                         browsers=browsers)  # fmt: skip
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http=protocol(header_timeout, max_connections),
            log_level="warning",
            access_log=False,  # ours (mlx_stream.serve.accesslog) replaces uvicorn's
            timeout_graceful_shutdown=5,  # seconds, then open connections are cut
        )
        import signal

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                models.drain()  # running requests end at once: their streams get their end
                super().handle_exit(sig, frame)

        # uvicorn raises the signal again once it has stopped: handled here, it lets
        # engine.stop() save the sessions and the process exit 0.
        signal.signal(signal.SIGTERM, lambda sig, frame: models.drain())
        Server(config).run()
    finally:
        models.close(save=scratch is None)  # saved to --state-dir, if one was given
        if scratch is not None:
            scratch.cleanup()
