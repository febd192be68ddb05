"""A stored cache file whose header lies (a prefix-store entry, a saved session: what
``serve`` loads from disk) is refused before any cache is built: a miss, the entry
removed with one log line, never an allocation the header asks for. Each hostile file
is read in a child process, so a crash fails the test instead of the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests.support.paths import REPO

CASES = [
    "window_1e8", "sinks_1e8", "slack_1e8", "window_other", "heads_x50", "int_array",
    "kv_bits_3", "positions", "seen_negative", "seen_huge", "filled_over", "slots_short",
    "layers_x1000", "meta_not_dict", "foreign_class", "layers_not_list", "memory",
]  # fmt: skip

CHILD = textwrap.dedent(
    """
    import json, logging, shutil, sys
    sys.path.insert(0, {repo!r})
    import mlx.core as mx
    from mlx_stream import prefix_store as ps
    from mlx_stream.cache import estimate
    from mlx_stream.errors import UserError
    from tests.test_prefix_store import make_session
    from tests import tiny

    folder, cases = sys.argv[1], sys.argv[2].split(",")
    model, tokenizer = tiny.make_model("llama"), tiny.make_tokenizer()
    store = ps.PrefixStore(folder + "/store")
    s = make_session(model, tokenizer, store)
    for _ in s.prefill_stored(s.system_text(), store):
        pass
    key = s.prefix_key(s.system_text())
    path = store.path(key)
    shutil.copy(path, folder + "/pristine")
    s.save(folder + "/chat")

    def rewrite(path, case):
        arrays, meta = mx.load(str(path), return_metadata=True)
        mx.eval(list(arrays.values()))
        layers = json.loads(meta["mlx_stream"])["layers"]
        first = layers[0]["meta"]
        if case.endswith("_1e8"):
            for layer in layers:
                layer["meta"][case.split("_")[0]] = 10**8
        elif case == "window_other":  # a consistent header for another policy
            first["window"] += 64
            first["slots"] += [-1] * 64
        elif case in ("heads_x50", "int_array"):
            name = "0.0"
            a = arrays[name]
            arrays[name] = (mx.concatenate([a] * 50, axis=1) if case == "heads_x50"
                            else a.astype(mx.int32))
        elif case == "kv_bits_3":
            first["kv_bits"] = 3
        elif case == "positions":
            first["positions"] = "sideways"
        elif case == "seen_negative":
            first["tokens_seen"] = -1
        elif case == "seen_huge":
            first["tokens_seen"] = 2**70
        elif case == "filled_over":
            first["filled"] = len(first["slots"]) + 1
        elif case == "slots_short":
            first["slots"] = first["slots"][:-1]
        elif case == "layers_x1000":
            layers = layers * 1000
        elif case == "meta_not_dict":
            layers[0]["meta"] = 5
        elif case == "foreign_class":
            layers[0]["class"] = "Popen"
        elif case == "layers_not_list":
            layers = {{"0": layers[0]}}
        meta["mlx_stream"] = json.dumps({{"layers": layers}})
        mx.save_safetensors(str(path), arrays, meta)

    results = {{}}
    for case in cases:
        real = estimate.available_memory
        if case == "memory":  # a header needing more than the machine has
            estimate.available_memory = lambda: 10**4  # the tiny caches: ~52 kB
        shutil.copy(folder + "/pristine", path)
        rewrite(path, case if case != "memory" else "none")
        fresh = ps.PrefixStore(folder + "/store")
        got = fresh.lookup(key, model)
        results[case] = {{"miss": got is None, "removed": not path.exists(),
                         "rejected": fresh.rejected}}
        chat = folder + "/chat.safetensors"
        shutil.copy(chat, folder + "/chat.copy")
        rewrite(chat, case if case != "memory" else "none")
        try:
            make_session(model, tokenizer).load(folder + "/chat")
            results[case]["session"] = "loaded"
        except UserError as e:
            results[case]["session"] = str(e)
        shutil.copy(folder + "/chat.copy", chat)
        estimate.available_memory = real
    shutil.copy(folder + "/pristine", path)
    results["pristine"] = ps.PrefixStore(folder + "/store").lookup(key, model) is not None
    make_session(model, tokenizer).load(folder + "/chat")

    # a stream-run checkpoint, through the same loader
    from mlx_stream import checkpoint as ckpt
    from mlx_stream.cache.sink import make_sink_cache

    caches = make_sink_cache(model, sinks=4, window=32)
    model(mx.array([tiny.random_tokens(50)]), cache=caches)
    identity = {{"model": "tiny", "sinks": 4, "window": 32, "positions": "cache"}}
    saved = folder + "/run.safetensors"
    ckpt.save(saved, caches, {{"position": 50}}, identity)
    shutil.copy(saved, folder + "/run.copy")
    ckpt.load(saved, model)
    for case in ("window_1e8", "heads_x50", "layers_x1000"):
        shutil.copy(folder + "/run.copy", saved)
        rewrite(saved, case)
        try:
            ckpt.load(saved, model)
            results["checkpoint " + case] = "loaded"
        except UserError as e:
            results["checkpoint " + case] = str(e)
    print(json.dumps(results), flush=True)
    """
)


def test_a_hostile_header_is_a_miss_removed_and_never_allocated(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO)))
    env = {**os.environ, "MLX_STREAM_BLAS": "off"}
    p = subprocess.run(
        [sys.executable, str(script), str(tmp_path), ",".join(CASES)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]  # a segfault is -11
    results = json.loads(p.stdout.strip().splitlines()[-1])
    assert results.pop("pristine") is True  # the untouched entry and session load
    for case in ("window_1e8", "heads_x50", "layers_x1000"):
        said = results.pop("checkpoint " + case)
        assert said != "loaded" and "\n" not in said, (case, said)
    for case, r in results.items():
        assert r["miss"] and r["removed"] and r["rejected"] == 1, (case, r)
        if case != "window_other":  # a session may load another window: its own file
            assert r["session"] != "loaded" and "\n" not in r["session"], (case, r)
    warnings = [ln for ln in p.stderr.splitlines() if "prefix store: removed" in ln]
    assert len(warnings) == len(CASES), p.stderr[-3000:]
