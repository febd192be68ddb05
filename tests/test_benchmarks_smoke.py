"""Every benchmark script runs end to end on the tiny model (``--quick``) and prints
JSON lines with the expected keys and finite figures."""

import pytest

from tests.support.bench import ENVIRONMENT_KEYS, load_script, run


def test_decode(monkeypatch, tmp_path, tiny_model_dir):
    lines = run("decode", monkeypatch, tmp_path, tiny_model_dir)
    *rows, summary = lines
    assert {r["cache"] for r in rows} == {"sink", "rotating", "full"}
    for r in rows:
        assert ENVIRONMENT_KEYS | {"model", "context", "tok_s", "p50_ms", "p90_ms"} <= set(r)
        assert {"kv_mb", "process_active_mb", "process_peak_mb", "prefill_tps"} <= set(r)
        assert r["tok_s"] > 0 and r["p90_ms"] >= r["p50_ms"] > 0 and r["bare_p50_ms"] > 0
    assert summary["summary"] and "sink_p50_growth" in summary
    assert any(k.startswith("sink_over_rotating_tok_s_") for k in summary)
    assert summary["sink_over_rotating_bare_ms_96"] > 0
    lo, hi = summary["sink_over_rotating_tok_s_96_range"]  # one ratio per repeat
    assert 0 < lo <= summary["sink_over_rotating_tok_s_96"] * 1.001 and lo <= hi
    assert "| sink |" in load_script("tables", monkeypatch).decode_tables(lines)
    # tables.py renders every results file of a kind, named in its heading.
    results = tmp_path / "results"
    results.mkdir()
    for name in ("decode.jsonl", "decode_long.jsonl"):
        (results / name).write_text((tmp_path / "decode.jsonl").read_text())
    text = load_script("tables", monkeypatch).main(["--results", str(results)])
    assert "### Decode (`decode.jsonl`)" in text and "### Decode (`decode_long.jsonl`)" in text


def test_attention(monkeypatch, tmp_path, tiny_model_dir):
    lines = run("attention", monkeypatch, tmp_path, tiny_model_dir)
    assert [r["contender"] for r in lines] == ["rotating", "sink", "sink-bool"]
    keys = {r["contender"]: r["keys"] for r in lines}
    # rotating and the default sink cache (slack 0) attend to sinks + window keys; a sink
    # cache with 64 slack slots also to them (masked)
    assert keys == {"rotating": 4 + 32, "sink": 4 + 32, "sink-bool": 4 + 32 + 64}
    assert lines[0]["over_rotating"] == 1.0 and all(r["ms_per_token"] > 0 for r in lines)
    assert ENVIRONMENT_KEYS | {"layers", "heads", "kv_heads", "head_dim"} <= set(lines[0])
    assert "| sink-bool | 100 |" in load_script("tables", monkeypatch).attention_tables(lines)


def test_prefill_attention(monkeypatch, tmp_path, tiny_model_dir):
    *rows, summary = run("prefill_attention", monkeypatch, tmp_path, tiny_model_dir)
    assert [r["keys"] for r in rows] == [36, 72] and summary["summary"]
    for r in rows:
        parts = ("sdpa", "qk", "softmax", "pv", "exp_mlx", "exp_numpy")
        assert all(r[f"{p}_ms"] > 0 for p in parts)
        assert abs(r["softmax_share"] - r["softmax_ms"] / r["sdpa_ms"]) < 0.01  # rounded ms
    assert abs(summary["sdpa_72_over_36"] - rows[1]["sdpa_ms"] / rows[0]["sdpa_ms"]) < 0.01


def test_decode_across_windows(monkeypatch, tmp_path, tiny_model_dir):
    # head_dim 16: the 8-bit cache's group size cannot divide it, float caches only here
    lines = run("decode", monkeypatch, tmp_path, tiny_model_dir, "--windows", "16,32",
                "--caches", "sink,rotating")  # fmt: skip
    *rows, summary = lines
    assert [(r["cache"], r["window"]) for r in rows] == [
        ("sink", 16), ("rotating", 16), ("sink", 32), ("rotating", 32)
    ]  # fmt: skip
    assert all(r["tok_s"] > 0 and len(r["run_tok_s"]) == 2 for r in rows)
    for w in (16, 32):
        lo, hi = summary[f"sink_over_rotating_{w}_range"]
        assert 0 < lo <= summary[f"sink_over_rotating_{w}"] <= hi


def test_quantized_attention_routes_agree(monkeypatch, tmp_path, tiny_model_dir):
    lines = run("quantized_attention", monkeypatch, tmp_path, tiny_model_dir)
    script = load_script("quantized_attention", monkeypatch)
    assert {r["contender"] for r in lines} == set(script.CONTENDERS)
    assert all(r["us"] > 0 for r in lines)
    # The quantized-kernel route on per-channel keys computes what dequantizing does.
    import mlx.core as mx

    fns = script.contenders(99, 9, 3, 64)
    ref = fns["float"]()
    assert mx.allclose(fns["qmm-k4"](), fns["dequant-k4"](), atol=1e-4).item()
    assert mx.abs(fns["qmm-8"]() - ref).max().item() < 0.02
    assert mx.abs(fns["qmm-k8"]() - ref).max().item() < 0.02
    # The cache's own route (cache_route checks it against float attention as well)
    for bits in (8, 4):
        route, dequantized = script.cache_route(64, 4, bits, 9, 3, 64)
        assert mx.allclose(route(), dequantized(), atol=1e-4).item()


def test_block_exactness(monkeypatch, tmp_path):
    from tests import tiny

    folder = tiny.save_model_folder(
        tmp_path / "hd64", num_attention_heads=1, num_key_value_heads=1
    )  # head_dim 64: 4-bit keys and values
    lines = run("block_exactness", monkeypatch, tmp_path, folder, "--dtypes", "bfloat16")
    assert {r["cache"] for r in lines} == {"kvcache", "sink", "sink-8", "sink-4"}
    for r in lines:  # bfloat16: a block's rows are the single steps' rows, bit for bit
        assert r["tokens"] == 80 and r["rows_differing"] == 0 and r["max_abs_diff"] == 0


def test_key_schemes(monkeypatch, tmp_path):
    from tests import tiny

    folder = tiny.save_model_folder(
        tmp_path / "hd64", num_attention_heads=1, num_key_value_heads=1
    )  # head_dim 64: every group size
    lines = run("key_schemes", monkeypatch, tmp_path, folder)
    errors = {r["scheme"]: r["mean_error"] for r in lines}
    assert {"k4g64", "had4g32", "kivi4g32", "v4g64"} <= set(errors)
    assert all(0 <= r["mean_error"] <= r["max_error"] for r in lines)
    assert errors["k8g64"] < errors["k4g64"]  # more bits, less error


def test_decode_splits_loop_and_cache(monkeypatch, tmp_path, tiny_model_dir, capsys):
    lines = run("decode", monkeypatch, tmp_path, tiny_model_dir, "--caches",
                "sink,rotating,rotating-ours")  # fmt: skip
    *rows, summary = lines
    assert {r["cache"] for r in rows} == {"sink", "rotating", "rotating-ours"}
    for c in (48, 96):  # the sink/rotating ratio is the product of the two parts
        parts = summary[f"sink_over_rotating_ours_tok_s_{c}"]
        parts *= summary[f"rotating_ours_over_rotating_tok_s_{c}"]
        assert parts == pytest.approx(summary[f"sink_over_rotating_tok_s_{c}"], rel=0.01)
    assert "Loop (ours/mlx-lm" in load_script("tables", monkeypatch).decode_tables(lines)
    with pytest.raises(SystemExit):
        load_script("decode", monkeypatch).main(["--quick", "--caches", "sink,rotatin"])
    assert "unknown cache rotatin" in capsys.readouterr().err


def test_decode_full_max(monkeypatch, tmp_path, tiny_model_dir):
    lines = run("decode", monkeypatch, tmp_path, tiny_model_dir, "--full-max", "48")
    *rows, summary = lines
    contexts = {c: {r["cache"] for r in rows if r["context"] == c} for c in (48, 96)}
    assert contexts == {48: {"sink", "rotating", "full"}, 96: {"sink", "rotating"}}
    assert "full_p50_growth" not in summary  # one full-cache context: no growth to report


def test_spec_memory(monkeypatch, tmp_path, tiny_model_dir):
    png = tmp_path / "pool.png"
    lines = run("spec_memory", monkeypatch, tmp_path, tiny_model_dir, "--plot", str(png))
    assert [r["contender"] for r in lines] == ["sink-crossing", "sink-exact", "mlx-lm"]
    for r in lines:
        assert ENVIRONMENT_KEYS | {"model", "tokens", "pool_mb_max", "active_mb_max"} <= set(r)
        assert len(r["series"]["tokens"]) == len(r["series"]["pool_mb"]) > 0
    assert lines[0]["reclaims"] > 0  # the crossing rule fires under speculative jumps
    assert png.stat().st_size > 1000
    assert "| mlx-lm |" in load_script("tables", monkeypatch).spec_tables(lines)
    again = tmp_path / "again.png"
    script = load_script("spec_memory", monkeypatch)
    replotted = script.main(["--replot", str(tmp_path / "spec_memory.jsonl"), "--plot", str(again)])
    assert replotted == lines and again.stat().st_size > 1000


def test_perplexity(monkeypatch, tmp_path, tiny_model_dir):
    png = tmp_path / "ppl.png"
    lines = run("perplexity", monkeypatch, tmp_path, tiny_model_dir, "--plot", str(png))
    configs = [r["config"] for r in lines]
    assert "sinks=4 window=32" in configs and "sinks=4 window=32 absolute" in configs
    assert any(c.startswith("full cache") for c in configs)
    oracle = next(r for r in lines if r["config"].startswith("recompute"))
    assert oracle["perplexity"] > 0 and oracle["same_tokens_perplexity"]
    fast = lines[-1]
    assert fast["perplexity_rel_diff"] < 1e-4 and fast["speedup"] > 0
    assert all(r["segments"] for r in lines if "segments" in r)
    assert png.stat().st_size > 1000
    assert "(oracle)" in load_script("tables", monkeypatch).perplexity_tables(lines)
    # --replot draws the same figure from the saved lines, without the model.
    again = tmp_path / "again.png"
    script = load_script("perplexity", monkeypatch)
    replotted = script.main(["--replot", str(tmp_path / "perplexity.jsonl"), "--plot", str(again)])
    assert [r["config"] for r in replotted] == [r["config"] for r in lines if r.get("segments")]
    assert again.stat().st_size > 1000


@pytest.mark.parametrize("name", ["perplexity", "spec_memory"])
def test_replot_bad_input_is_a_usage_error(name, monkeypatch, tmp_path, capsys):
    script = load_script(name, monkeypatch)
    empty, binary, png = tmp_path / "empty.jsonl", tmp_path / "bin.jsonl", tmp_path / "x.png"
    empty.write_text("")
    binary.write_bytes(b"\x89PNG\x00\xff")
    for path, says in [(tmp_path / "missing.jsonl", "no such file"), (empty, "nothing to plot"),
                       (binary, "not JSON lines")]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            script.main(["--replot", str(path), "--plot", str(png)])
        assert exit_info.value.code == 2
        assert says in capsys.readouterr().err.strip().splitlines()[-1]
    assert not png.exists()


@pytest.mark.slow
def test_blas(monkeypatch, tmp_path, tiny_model_dir):
    *rows, summary = run("blas", monkeypatch, tmp_path, tiny_model_dir)
    assert [r["config"] for r in rows] == ["netlib", "openblas"]
    for r in rows:
        assert ENVIRONMENT_KEYS | {
            "mlx_gflops",
            "numpy_gflops",
            "prefill_tps",
            "decode_tps",
        } <= set(r)
    assert rows[0]["blas_state"] == "off"
    assert summary["summary"] and set(summary["configs"]) == {"netlib", "openblas"}
    assert "| netlib |" in load_script("tables", monkeypatch).blas_tables([*rows, summary])


def test_perplexity_skips_sections_set_to_zero(monkeypatch, tmp_path, tiny_model_dir):
    lines = run(
        "perplexity", monkeypatch, tmp_path, tiny_model_dir,
        "--full", "0", "--oracle", "0", "--throughput", "0",
    )  # fmt: skip
    configs = [r["config"] for r in lines]
    assert configs and all(c.startswith("sinks=") for c in configs)


def test_recall(monkeypatch, tmp_path, tiny_model_dir):
    lines = run("recall", monkeypatch, tmp_path, tiny_model_dir, "--caches", "recall,window",
                "--ranks")  # fmt: skip
    assert {r["cache"] for r in lines} == {"recall", "window"}
    for r in lines:
        assert ENVIRONMENT_KEYS | {"length", "kind", "depth", "found", "answer"} <= set(r)
    assert all(r["store_bytes"] > 0 for r in lines if r["cache"] == "recall")
    ranked = [r for r in lines if r["cache"] == "recall"][0]
    # every selector whose summaries the tier keeps (quest's, by default) or reading the keys
    assert set(ranked["ranks"]) == {"exact", "quest", "token"}
    assert all(0 <= x < ranked["candidate_blocks"] for v in ranked["ranks"].values() for x in v)
    assert 0 <= ranked["own_topk"]["layers"] <= 1 and 0 <= ranked["own_topk"]["heads"] <= 1
    table = load_script("recall", monkeypatch).render(lines)
    assert "| 400 | passkey | filler |" in table


def test_recall_offline_ranks_a_dump_as_the_run_ranked_it(monkeypatch, tmp_path, tiny_model_dir):
    dumps = tmp_path / "dumps"
    lines = run("recall", monkeypatch, tmp_path, tiny_model_dir, "--caches", "recall",
                "--ranks", "--dump", str(dumps))  # fmt: skip
    ranked = lines[0]["ranks"]
    out = tmp_path / "offline.jsonl"
    records = load_script("recall_offline", monkeypatch).main(
        [str(dumps), "--blocks", "2", "--balls", "1:2:2:100000:1000,1:2:2:8:2", "--out", str(out)]
    )
    *rows, summary = records
    assert len(rows) == len(list(dumps.glob("*.npz"))) == 1
    got = rows[0]["ranks"]
    # the same prompt end scored again from its dump: the run's own ranks (float16 keys)
    for name in ("token", "exact", "quest"):
        assert got[name] == min(ranked[name])
    # balls read until every key is read, every block kept: the flat scan again
    assert got["balls-1-2-2-100000-1000"] == got["token"]
    every, few = rows[0]["cost"]["balls-1-2-2-100000-1000"], rows[0]["cost"]["balls-1-2-2-8-2"]
    assert every["read"] == 1 and every["reranked"] == rows[0]["candidates"]
    assert 0 < few["read"] < 1 and few["reranked"] <= 2 * 3 and few["work"] < every["work"]
    assert summary["selectors"]["token"]["dumps"] == 1 and summary["k"] == 2
    # the run chose in pairs with token (the defaults): the same verdict on the needle
    run_whole = all(b in lines[0]["selection"] for b in lines[0]["needle_blocks"])
    assert rows[0]["whole"]["token"]["pairs"] == run_whole
    assert summary["selectors"]["token"]["whole_pairs"] == int(run_whole)


@pytest.mark.parametrize("flags", [["--balls", "1:2"], ["--balls", "1:2:2:0:4"]])
def test_recall_offline_refuses_a_bad_spec_in_one_line(monkeypatch, tmp_path, capsys, flags):
    main = load_script("recall_offline", monkeypatch).main
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path), *flags, "--out", str(tmp_path / "x.jsonl")])
    assert stop.value.code == 2 and not (tmp_path / "x.jsonl").exists()
    assert f"error: {flags[0]} '{flags[1]}'" in capsys.readouterr().err


def test_recall_offline_balls_bound_every_member(monkeypatch):
    import numpy as np

    kmeans = load_script("recall_offline", monkeypatch).kmeans
    rng = np.random.default_rng(0)
    x, q = rng.standard_normal((300, 16)), rng.standard_normal((5, 16))
    centroids, radius, member = kmeans(x, 7)
    assert set(member) <= set(range(7)) and len(set(member)) > 1
    assert (np.linalg.norm(x - centroids[member], axis=1) <= radius[member] + 1e-9).all()
    bound = q @ centroids.T + np.linalg.norm(q, axis=1)[:, None] * radius[None]
    assert (q @ x.T <= bound[:, member] + 1e-9).all()  # no key beats its ball's bound


def test_recall_chat(monkeypatch, tmp_path, tiny_model_dir):
    lines = run("recall_chat", monkeypatch, tmp_path, tiny_model_dir)
    assert [r["cache"] for r in lines] == ["window", "recall"]
    for r in lines:
        assert ENVIRONMENT_KEYS <= set(r) and isinstance(r["found"], bool)
        assert r["conversation_tokens"] >= 600 and 0 < r["fact_distance"] < r["conversation_tokens"]
    recall = lines[1]
    assert recall["stored_blocks"] > 0 and recall["store_bytes"] > 0


def test_recall_persist(monkeypatch, tmp_path, tiny_model_dir):
    lines = run("recall_persist", monkeypatch, tmp_path, tiny_model_dir)
    assert [r["store"] for r in lines] == ["float", "float-spilled"]
    assert all(r["identical"] and r["same_selections"] and r["stored_blocks"] > 0 for r in lines)
    assert lines[1]["store_disk_mb"] > 0 and lines[1]["restored_disk_mb"] > 0


def test_recall_decode(monkeypatch, tmp_path, tiny_model_dir):
    lines = run("recall_decode", monkeypatch, tmp_path, tiny_model_dir, "--profile")
    *rows, summary = lines
    names = {"recall", "window", "window-slack"}
    assert {r["cache"] for r in rows if r["phase"] == "prefill"} == names
    decode = [r for r in rows if r["phase"] == "decode"]
    assert len(decode) == 3 * summary["rounds"]
    for r in decode:  # 64 steps cross exactly one block boundary
        assert r["steps"] == 64 and len(r["boundaries"]) == 1 and r["ms_per_step"] > 0
        if r["cache"] == "recall":
            assert r["refreshes"] == 1 and r["selection"] and r["rebuilds"] >= 0
    # the ratio is the one of the medians the summary reports
    ms = summary["ms_per_step"]
    assert summary["recall_over_window"] == pytest.approx(ms["recall"] / ms["window"], abs=2e-3)
    lo, hi = summary["recall_over_window_range"]
    assert 0 < lo <= summary["recall_over_window_median_round"] <= hi
    keys = summary["attn_keys"]  # the region adds k blocks of keys to the ring's
    assert keys["recall"] == keys["keys-only"] > keys["window-slack"] > keys["window"]
    assert set(summary["attn_layer_ms"]) == {"recall", "window", "window-slack", "keys-only"}
    assert summary["refresh_ms_per_step"] > 0
    parts = summary["refresh_profile_ms"]  # cProfile of the rounds' refreshes
    assert parts["gather_queries"] > 0 and parts["score_blocks"] > 0


def test_recall_soak(monkeypatch, tmp_path, tiny_model_dir):
    store = tmp_path / "store"
    lines = run("recall_soak", monkeypatch, tmp_path, tiny_model_dir, "--folder", str(store),
                "--keep")  # fmt: skip
    *samples, summary = lines
    assert summary["summary"] and summary["tokens"] == samples[-1]["tokens"] == 2048
    steady = samples[1:]
    assert len(steady) >= 4
    # device bytes of the caches and the regions do not grow; the store does, on disk
    assert len({r["cache_mb"] for r in steady}) == 1 and len({r["region_mb"] for r in steady}) == 1
    blocks = [r["stored_blocks"] for r in samples]
    assert blocks == sorted(blocks) and blocks[-1] > blocks[0]
    assert samples[-1]["store_disk_mb"] > 0 and samples[-1]["store_ram_mb"] <= 0.05
    assert any(p.suffix == ".npy" for p in store.iterdir())  # --keep kept the files
    assert all(r["refresh_s_per_1k"] >= 0 and r["s_per_1k"] > 0 for r in samples)
    table = load_script("recall_soak", monkeypatch).render(lines)
    assert table.count("\n| ") == len(samples) and "| 2,048 |" in table
    with pytest.raises(SystemExit) as e:  # a folder already holding files is refused
        load_script("recall_soak", monkeypatch).main(
            ["--quick", "--model", str(tiny_model_dir), "--folder", str(store)]
        )
    assert e.value.code == 2


def test_repair(monkeypatch, tmp_path, tiny_model_dir):
    lines = run("repair", monkeypatch, tmp_path, tiny_model_dir)
    rows = [r for r in lines if r["bench"] == "repair"]
    summaries = [r for r in lines if r["bench"] == "repair-summary"]
    assert {r["k"] for r in summaries} == {0, 16} and len(rows) == 2 * summaries[0]["edits"]
    for r in rows:
        assert r["rebuild_ttft_s"] > 0 and r["repair_ttft_s"] > 0 and r["first_token_kl"] >= 0
        assert r["recomputed"] >= 0 and r["reused"] > 0  # a tiny vocabulary may not see an edit
