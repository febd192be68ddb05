"""Run one model sharded over several processes with MLX distributed (``mlx.launch``).

Contract: every rank runs the same command on the same inputs and takes the same
steps; rank 0 alone reads input and talks to the world, handing each piece to the
others over MLX's collectives (:meth:`Cluster.share_bytes`). The model is sharded by
mlx-lm (tensor parallel or pipeline) while its weights are lazy; a model that cannot
be sharded is refused before a weight is read. Ctrl-C ends every rank, and a rank
whose peer left ends itself instead of hanging (:func:`_watch_peers`).
"""

from __future__ import annotations

import atexit
import io
import json
import os
import random
import signal
import socket
import stat
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_stream.errors import RuntimeFailure, UserError

MODES = ("auto", "tensor", "pipeline", "off")
LAUNCH_ENV = ("MLX_RANK", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "OMPI_COMM_WORLD_SIZE")
PEER_LOST = "connection to a peer was lost"
EXIT_INTERRUPTED = 130
FOLLOWER_ERROR_DELAY = 3.0
PEER_GRACE = 2.0  # seconds a rank may sit still after a peer left before it ends itself
WATCH_EVERY = 0.25
LAUNCH_EXAMPLE = "mlx.launch --backend ring --hosts 127.0.0.1 -n 2 --python $(which python) $(which mlx-stream) ..."  # fmt: skip


def launched() -> bool:
    """Whether this process was started by ``mlx.launch`` (or ``mpirun``)."""
    return any(os.environ.get(name) for name in LAUNCH_ENV)


def free_port_base(ranks: int) -> int:
    """A loopback port with ``ranks`` free ports from it (ring rank r listens on base + r)."""
    rng = random.Random()
    for _ in range(50):
        base = rng.randrange(20000, 60000)
        try:
            for port in range(base, base + ranks):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeFailure("no free loopback ports for the ranks")


def loopback_launch(ranks: int, program: list[str], python: str = sys.executable) -> list[str]:
    """The ``mlx.launch`` command that runs ``python PROGRAM`` on ``ranks`` ring ranks on
    this machine (the launcher installed beside ``python``)."""
    launcher = Path(python).parent / "mlx.launch"
    return [str(launcher), "--backend", "ring", "--hosts", "127.0.0.1", "-n", str(ranks),
            "--starting-port", str(free_port_base(ranks)), "--python", python, *program]  # fmt: skip


def loopback_envs(ranks: int, folder: Path) -> list[dict[str, str]]:
    """The environment of each of ``ranks`` ring ranks on this machine, as ``mlx.launch``
    sets it (a hostfile written in ``folder``, ``MLX_RANK``), to start the ranks by hand."""
    base = free_port_base(ranks)
    hostfile = Path(folder) / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(ranks)]))
    return [dict(os.environ, MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile)) for r in range(ranks)]


def is_peer_lost(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because another rank went away: the
    end of the run, not one failed operation to recover from."""
    return isinstance(error, RuntimeError) and PEER_LOST in str(error)


def _settle() -> None:
    """Wait for the model's collectives still in flight on any stream we know of.

    mlx-lm decodes on its own ``generation_stream`` and dispatches the next step before
    it yields a token; a collective of ours on another stream would run beside it and
    the ranks would pair up different collectives (seen: garbled input on rank 1).
    """
    from mlx_stream.mlxlm import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()


def _settle_quietly() -> None:
    """At exit: finish the collectives this rank dispatched (a decode loop dispatches
    one step ahead); a rank that left them pending would break its peers' matching
    ones. A peer already gone makes this fail at once, which is fine here."""
    try:
        _settle()
    except RuntimeError:
        pass


@dataclass
class Cluster:
    """The process group one sharded model runs on, and how it is sharded.

    Attributes:
        group: MLX's global group.
        mode: What the user asked for: ``"auto"``, ``"tensor"`` or ``"pipeline"``.
        strategy: How the model was sharded (set by :func:`shard`), or ``None``.
    """

    group: Any
    mode: str = "auto"
    strategy: str | None = None

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def _sum(self, array: mx.array) -> mx.array:
        _settle()
        out = mx.distributed.all_sum(array, group=self.group, stream=mx.cpu)
        mx.eval(out)
        return out

    def share_bytes(self, data: bytes | None) -> bytes | None:
        """Rank 0's ``data`` on every rank (``None`` too); other ranks pass anything."""
        mine = self.is_root
        n = -1 if data is None else len(data)
        n = int(self._sum(mx.array([n if mine else 0], dtype=mx.int32)).item())
        if n <= 0:
            return None if n < 0 else b""
        payload = np.frombuffer(data, dtype=np.uint8) if mine else np.zeros(n, np.uint8)
        out = self._sum(mx.array(payload.astype(np.int32)))
        return np.array(out).astype(np.uint8).tobytes()

    def share_text(self, text: str | None) -> str | None:
        """Rank 0's ``text`` on every rank (``None`` stays ``None``)."""
        data = self.share_bytes(None if text is None else text.encode())
        return None if data is None else data.decode()

    def share_int(self, value: int) -> int:
        """Rank 0's integer on every rank."""
        return int(self._sum(mx.array([value if self.is_root else 0], dtype=mx.int64)).item())

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (same length everywhere), rank by rank."""
        row = mx.array([values], dtype=mx.float32)
        _settle()
        out = mx.distributed.all_gather(row, group=self.group, stream=mx.cpu)
        return np.array(out).tolist()

    def barrier(self) -> None:
        """Return once every rank got here."""
        self._sum(mx.array([1], dtype=mx.int32))

    def stream(self, source: Any = None, refuse: dict[str, str] | None = None) -> SharedStream:
        """A text stream that reads ``source`` on rank 0 and rank 0's reads elsewhere."""
        return SharedStream(self, source if self.is_root else None, refuse)


class SharedStream(io.TextIOBase):
    """A text stream every rank reads alike: rank 0 reads its real source and shares
    each ``read``/``readline`` result, the others receive it (the calls must match).

    ``refuse`` maps a line prefix to a reason: such lines are answered on rank 0 with
    ``Error: <reason>`` and never shared (e.g. chat's /save of a sharded cache).
    """

    def __init__(self, cluster: Cluster, source: Any, refuse: dict[str, str] | None = None):
        self.cluster = cluster
        self.source = source
        self.refuse = refuse or {}

    def readable(self) -> bool:
        return True

    def _share(self, read) -> str:
        return self.cluster.share_text(read() if self.cluster.is_root else "") or ""

    def read(self, n: int | None = -1) -> str:
        return self._share(lambda: self.source.read(n))

    def readline(self, limit: int = -1) -> str:
        return self._share(lambda: self._accepted_line(limit))

    def _accepted_line(self, limit: int) -> str:
        raw = getattr(self.source, "buffer", None)  # bytes that are not UTF-8 become U+FFFD
        while True:
            if raw is not None:
                line = raw.readline(limit).decode("utf-8", errors="replace")
            else:
                line = self.source.readline(limit)
            reason = next((r for p, r in self.refuse.items() if line.lstrip().startswith(p)), None)
            if reason is None:
                return line
            sys.stderr.write(f"Error: {reason}\n")
            sys.stderr.flush()

    def isatty(self) -> bool:
        return False


# --------------------------------------------------------------------------- start


def start(mode: str = "auto", backend: str = "any") -> Cluster | None:
    """Join the ``mlx.launch`` group, or ``None`` for a single process.

    ``auto`` shards when launched with more than one rank; ``tensor`` or ``pipeline``
    insist on that strategy (and on a launch); ``off`` never shards. On a cluster, every
    rank gets rank 0's random seed, the other ranks' output is silenced, and Ctrl-C
    ends every rank.

    Raises:
        UserError: Unknown mode, or a strategy asked for outside ``mlx.launch``.
        RuntimeFailure: The backend could not connect the ranks.
    """
    if mode not in MODES:
        raise UserError(f"unknown --distributed mode '{mode}' (choose from: {', '.join(MODES)})")
    if mode == "off" or (mode == "auto" and not launched()):
        return None
    if not launched():
        raise UserError(f"--distributed {mode} runs under mlx.launch, e.g. {LAUNCH_EXAMPLE}")
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except (RuntimeError, ValueError) as e:
        raise RuntimeFailure(f"cannot join the distributed group: {e}") from None
    if group.size() == 1:
        return None
    cluster = Cluster(group, mode)
    if not os.environ.get("MLX_STREAM_DEBUG"):
        _quiet_followers(cluster)
    _end_on_interrupt(cluster)
    atexit.register(_settle_quietly)
    mx.random.seed(cluster.share_int(int.from_bytes(os.urandom(4), "little")))
    _watch_peers(cluster, ring_sockets())
    return cluster


class _RankStderr(io.TextIOBase):
    """stderr of a follower rank: only its own ``Error:`` lines, as ``rank N: Error: ...``,
    held back until exit (see :func:`_quiet_followers`); a lost peer is not one."""

    def __init__(self, rank: int, stream: Any):
        self.rank, self.stream = rank, stream
        self.held: list[str] = []

    def writable(self) -> bool:
        return True

    def write(self, text: str | bytes) -> int:
        if isinstance(text, bytes):  # click writes bytes to a stream it cannot place
            text = text.decode(errors="replace")
        for line in text.splitlines():
            if line.startswith("Error:") and PEER_LOST not in line:
                self.held.append(f"rank {self.rank}: {line}\n")
        return len(text)

    def report(self, wait: float = FOLLOWER_ERROR_DELAY) -> None:
        """Print the held errors after ``wait`` seconds, unless stopped before (by
        mlx.launch; the connection watch lets a rank on its way out finish)."""
        if self.held:
            _REPORTING.set()
            time.sleep(wait)
            self.stream.write("".join(self.held))
            self.stream.flush()


_REPORTING = threading.Event()  # a follower's own error is on its way out


def _quiet_followers(cluster: Cluster) -> None:
    # The ring backend writes "[ring] Socket N was closed by the peer" to fd 2 when a
    # rank dies: route fd 2 to /dev/null and keep Python's stderr on a copy of it.
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    stderr = open(saved, "w", buffering=1, closefd=True)  # noqa: SIM115 - lives with the process
    if cluster.is_root:
        sys.stderr = stderr
        return
    os.dup2(devnull, 1)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    # A follower's error waits a moment: when rank 0 failed the same way (a bad input,
    # a refusal: every rank sees it), mlx.launch stops this rank first and only rank
    # 0's line shows; an error of this rank alone still gets out.
    sys.stderr = _RankStderr(cluster.rank, stderr)
    atexit.register(sys.stderr.report)


def _end_on_interrupt(cluster: Cluster) -> None:
    def handler(signum, frame):
        if cluster.is_root:
            sys.stderr.write("Error: interrupted; every rank stops\n")
            sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)

    handler.final = True  # decode.StopOnInterrupt leaves a final handler in place
    signal.signal(signal.SIGINT, handler)
    # SIGTERM comes from mlx.launch stopping the ranks after one failed (it names the
    # rank): the default action ends a rank even while it waits inside a collective.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def ring_sockets() -> list[socket.socket]:
    """This process's connections to the other ranks of a ring group: the TCP
    sockets whose local or remote address is in ``MLX_HOSTFILE`` (copies of them, for
    looking only). Empty for other backends."""
    try:
        hosts = json.loads(open(os.environ["MLX_HOSTFILE"]).read())  # noqa: SIM115
        addresses = set()
        for node in hosts:
            for address in node if isinstance(node, list) else [node]:
                ip, _, port = str(address).rpartition(":")
                addresses.add((ip, int(port)))
    except (KeyError, OSError, ValueError, TypeError):
        return []
    fds = "/dev/fd" if os.path.isdir("/dev/fd") else f"/proc/{os.getpid()}/fd"
    found = []
    for name in os.listdir(fds):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except (ValueError, OSError):
            continue
        try:
            ends = {s.getsockname()[:2], s.getpeername()[:2]}
        except OSError:  # a listening socket
            ends = set()
        if s.type == socket.SOCK_STREAM and ends & addresses:
            found.append(s)
        else:
            s.close()
    return found


def _peer_left(s: socket.socket) -> bool:
    try:
        return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _watch_peers(cluster: Cluster, sockets: list[socket.socket]) -> None:
    """End this rank when a peer closed its connection and this rank stopped moving.

    MLX raises in the rank's own thread when it notices (the usual case, with the usual
    error line); this is for a collective that waits forever instead. "Stopped
    moving": the main thread's Python frame stayed the same for ``PEER_GRACE``
    seconds, so a rank still printing its last output is left to finish. (MLX's ring
    does not always fail a collective waiting on a peer that left: ml-explore/mlx#3862.)
    """
    if not sockets:
        return
    main = threading.main_thread().ident

    def where():
        frame = sys._current_frames().get(main)  # noqa: SLF001 - the stdlib's only frame reader
        return None if frame is None else (frame.f_code, frame.f_lasti)

    def watch():
        while not any(_peer_left(s) for s in sockets):
            time.sleep(WATCH_EVERY)
        last, since = where(), time.monotonic()
        while time.monotonic() - since < PEER_GRACE:
            time.sleep(WATCH_EVERY)
            now = where()
            if now != last:
                last, since = now, time.monotonic()
        if _REPORTING.is_set():
            return  # this rank's own error, not the lost peer, ends it
        if cluster.is_root:
            sys.stdout.flush()
            sys.stderr.write(f"Error: RuntimeError: [ring] {PEER_LOST}\n")
            sys.stderr.flush()
        os._exit(1)

    threading.Thread(target=watch, name="mlx-stream-peers", daemon=True).start()


# --------------------------------------------------------------------------- shard


def _config(model) -> dict:
    args = getattr(model, "args", None)
    return dict(vars(args)) if args is not None else {}


def strategies(model) -> list[str]:
    """The sharding strategies mlx-lm gives ``model``: ``tensor`` and/or ``pipeline``."""
    found = []
    if callable(getattr(model, "shard", None)):
        found.append("tensor")
    if callable(getattr(getattr(model, "model", None), "pipeline", None)):
        found.append("pipeline")
    return found


def _tensor_refusal(model, size: int) -> str | None:
    config = _config(model)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = config.get(key)
        if isinstance(value, int) and value % size:
            return f"its {value} {key.replace('_', ' ').replace('num ', '')} do not divide over {size} ranks"  # fmt: skip
    return None


def _pipeline_refusal(model, size: int) -> str | None:
    layers = len(model.model.layers)
    if layers < size:
        return f"its {layers} layers are fewer than {size} ranks"
    return None


def choose(model, size: int, mode: str = "auto") -> str:
    """The strategy for ``model`` over ``size`` ranks, or a one-line refusal.

    ``auto`` prefers tensor parallel (every rank works on every token), then pipeline.

    Raises:
        UserError: The model has no strategy that fits (the reason names the model).
    """
    name = getattr(model, "model_type", None) or _config(model).get("model_type", "model")
    found = strategies(model)
    if not found:
        raise UserError(
            f"cannot shard {name}: mlx-lm gives it neither tensor parallel (shard) "
            "nor pipeline support; run it on one machine"
        )
    wanted = ["tensor", "pipeline"] if mode == "auto" else [mode]
    reasons = []
    for strategy in wanted:
        if strategy not in found:
            reasons.append(f"{strategy}: mlx-lm has none for it")
            continue
        check = _tensor_refusal if strategy == "tensor" else _pipeline_refusal
        reason = check(model, size)
        if reason is None:
            return strategy
        reasons.append(f"{strategy}: {reason}")
    raise UserError(f"cannot shard {name} over {size} ranks: {'; '.join(reasons)}")


def shard(model, cluster: Cluster) -> str:
    """Cut ``model`` (weights still lazy) into this rank's shard; returns the strategy."""
    strategy = choose(model, cluster.size, cluster.mode)
    if strategy == "tensor":
        model.shard(cluster.group)
    else:
        model.model.pipeline(cluster.group)
    cluster.strategy = strategy
    return strategy


def preparer(cluster: Cluster | None):
    """The ``prepare`` hook for ``loader.load``: shard before the weights are read."""
    if cluster is None:
        return None
    return lambda model: shard(model, cluster)


# ------------------------------------------------------------------------ reporting


def weight_bytes(model) -> int:
    """Bytes of this rank's weights."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def rank_report(cluster: Cluster, model, kv_cache_mb: float, step_ms: float) -> dict:
    """Per-rank memory (weights, KV cache, MLX peak, in MB) and the collectives' share
    of a decode step (``step_ms``: this rank's median step), for ``profile``."""
    mb = 1e6
    mine = [weight_bytes(model) / mb, kv_cache_mb, mx.get_peak_memory() / mb]
    keys = ("weights_mb", "kv_cache_mb", "peak_memory_mb")
    ranks = [
        {"rank": r, **{k: round(v, 3) for k, v in zip(keys, row, strict=True)}}
        for r, row in enumerate(cluster.gather(mine))
    ]
    comm_ms = collective_seconds(cluster, model) * 1000
    return {
        "strategy": cluster.strategy,
        "ranks": ranks,
        "collective_ms": round(comm_ms, 3),
        "collective_share": round(comm_ms / step_ms, 3) if step_ms > 0 else None,
    }


def collective_seconds(cluster: Cluster, model, repeats: int = 20) -> float:
    """Time of one token's collectives alone (the same ops and sizes as a decode step).

    Tensor parallel sums the hidden state twice per layer (attention and MLP outputs).
    Pipeline: only the final ``all_gather`` is timed; the rank-to-rank send and receive
    also wait for the other ranks' layers, which is not communication alone.
    """
    hidden = _config(model).get("hidden_size") or model.model.embed_tokens.weight.shape[-1]
    layers = len(model.layers)
    x = mx.zeros((1, 1, hidden), dtype=mx.float32)
    group = cluster.group

    def step(x):
        if cluster.strategy == "tensor":
            for _ in range(2 * layers):
                x = mx.distributed.all_sum(x, group=group) * 0.5
            return x
        return mx.distributed.all_gather(x, group=group)[:1]

    mx.eval(step(x))
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(step(x))
    return (time.perf_counter() - start) / repeats


def join(mode: str, name: str | None) -> Cluster | None:
    """:func:`start`, then rank 0 pulls or converts ``name`` before the others look
    (ranks on one machine share the user cache)."""
    cluster = start(mode)
    if cluster is not None:
        if cluster.is_root:
            from mlx_stream.models import loader

            loader.resolve(name, fit=False)  # the model is sharded: no one machine holds it
        cluster.barrier()
    return cluster
