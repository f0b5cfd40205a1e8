"""``python -m dsflash.bench engine`` end to end on the engine's toy backend: every mode generates every token, the
speculative one reports its acceptance, and ``--breakdown`` times the parts of an iteration on the live engine."""
import json

from dsflash.bench import engine as bench_engine


def test_bench_engine_both_modes_and_breakdown(tmp_path, capsys):
    out = tmp_path / "engine.json"
    rc = bench_engine.main(["--model", "toy", "--num-prompts", "3", "--prompt-len", "8", "--max-tokens", "12",
                            "--max-num-seqs", "2", "--max-model-len", "64", "--page-size", "8",
                            "--prefill-buckets", "2x8", "--breakdown", "--repeats", "3", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    spec, adaptive, plain = res
    # the default modes: always drafting, the engine's default (adaptive deciding mixed steps too), plain
    assert [r["mode"] for r in res] == ["spec", "adaptive_mixed", "plain"]
    assert spec["speculative"] and adaptive["speculative"] and not plain["speculative"]
    assert set(json.loads(out.read_text())["ratios"]) == {"spec_over_plain", "adaptive_mixed_over_plain"}
    # the timed passes start once every program is compiled (EngineConfig.background_compile): no adaptive call ran
    # plain for want of the drafting program
    assert adaptive["spec_calls_before_drafting_compiled"] == 0
    for r in res:
        assert r["generated_tokens"] == 3 * 12 and r["programs_ready_s"] >= r["startup_s"]
        assert r["decode_iters"] > 0 and r["ms_per_decode_iter"] > 0
        # decode-only steps: a subset of the run's steps and iterations, each with its own time
        d = r["decode_phase"]
        assert 0 < d["steps"] < r["steps"] and 0 < d["iters"] <= r["decode_iters"] and d["ms_per_iter"] > 0
        # every step by kind: the kinds add up to the run's steps, iterations, emitted and prefilled tokens
        ph = r["phases"]
        assert ph["decode"]["steps"] == d["steps"] and ph["decode"]["iters"] == d["iters"]
        assert ph["mixed"]["steps"] > 0 and ph["decode"]["prompt_tokens"] == 0
        assert sum(v["steps"] for v in ph.values()) == r["steps"]
        assert sum(v["iters"] for v in ph.values()) == r["decode_iters"]
        assert sum(v["generated"] for v in ph.values()) == r["generated_tokens"]
        assert sum(v["prompt_tokens"] for v in ph.values()) == 3 * 8
        assert abs(sum(v["s"] for v in ph.values()) - r["elapsed_s"]) < 0.5 * r["elapsed_s"]
        assert r["compiles_after_warmup"] == 0
    # the toy draft often agrees with the toy target: fewer iterations than tokens per sequence
    assert spec["mean_acceptance_length"] > 1.2 and spec["decode_iters"] < plain["decode_iters"]
    b = spec["iteration_breakdown"]
    assert b["rows"] == 2 and b["block"] == 3
    assert min(b["forward_1_ms"], b["forward_block1_with_context_ms"], b["propose_ms"]) > 0
    assert abs(b["spec_model_work_in_plain_iterations"]
               - (b["forward_block1_with_context_ms"] + b["propose_ms"]) / b["forward_1_ms"]) < 1e-9
    assert "iteration_breakdown" not in plain
    text = capsys.readouterr().out
    assert "by step kind: mixed" in text and "breakdown (2 rows" in text and "spec / plain tokens/s" in text and "adaptive_mixed / plain tokens/s" in text


def test_ratios_pass_by_pass():
    """Session 29: the median passes' ratio alone hid how noisy it was (2-core CPU, passes +-10 %); each round's
    passes ran side by side, so the ratio pass by pass has its median and range in the JSON and the printed line."""
    res = [{"mode": "adaptive", "passes_tokens_per_s": [90.0, 120.0, 100.0], "tokens_per_s": 100.0},
           {"mode": "plain", "passes_tokens_per_s": [100.0, 100.0, 125.0], "tokens_per_s": 100.0}]
    got = bench_engine.ratios_by_round(res)
    assert set(got) == {"adaptive_over_plain"}
    r = got["adaptive_over_plain"]
    assert r["rounds"] == [0.9, 1.2, 0.8] and r["median"] == 0.9 and (r["min"], r["max"]) == (0.8, 1.2)
    assert bench_engine.ratios_by_round(res[:1]) == {}


def test_bench_engine_prints_the_ratio_by_round(tmp_path, capsys):
    out = tmp_path / "engine.json"
    assert bench_engine.main(["--model", "toy", "--num-prompts", "2", "--prompt-len", "8", "--max-tokens", "6",
                              "--max-num-seqs", "2", "--max-model-len", "64", "--page-size", "8",
                              "--prefill-buckets", "2x8", "--modes", "adaptive,plain", "--passes", "2",
                              "--json", str(out)]) == 0
    r = json.loads(out.read_text())["ratios_by_round"]["adaptive_over_plain"]
    assert len(r["rounds"]) == 2 and r["min"] <= r["median"] <= r["max"]
    assert "pass by pass over 2 rounds" in capsys.readouterr().out


def test_chat_prompts_are_held_out_first_turns_as_served():
    """``--chat-prompts``: the server's rendering of held-out conversations' first turns (BOS first, ending where the
    assistant's turn opens), only those that fit, and a clear exit when too few do."""
    import pytest

    from dsflash.api import SHIPPED
    from dsflash.chat import encode_chat
    from dsflash.tokenizer import Tokenizer
    from dsflash.train import chat_data
    tok = Tokenizer.from_folder(SHIPPED["demo"])
    got = bench_engine.chat_prompts(tok, 6, 64)
    _, held = chat_data.split(chat_data.conversations())
    want = [tok.encode(encode_chat(c["messages"][:1], tools=c["tools"], thinking=c["thinking"])) for c in held]
    assert got == [w for w in want if len(w) <= 64][:6] and len(got) == 6
    assert all(p[0] == tok.bos_id and tok.decode(p[-2:], skip_special_tokens=False).endswith(("think>",))
               for p in got)
    with pytest.raises(SystemExit, match="chat-prompts"):
        bench_engine.chat_prompts(tok, 6, 5)
    assert bench_engine.parse(["--chat-prompts"]).chat_prompts


def test_adaptive_mixed_mode_lets_the_cost_model_draft_in_steps_that_prefill(tmp_path):
    """``adaptive_mixed`` (EngineConfig.speculative_in_mixed_steps): the calls of steps that also prefill are the
    cost model's to decide where the budget has room, so none is forced plain; the prefill-first rule (mode
    adaptive) forces them plain (one prompt a step: the second and third prefill while the first decodes)."""
    out = tmp_path / "engine.json"
    rc = bench_engine.main(["--model", "toy", "--num-prompts", "3", "--prompt-len", "8", "--max-tokens", "12",
                            "--max-num-seqs", "3", "--max-model-len", "64", "--page-size", "8",
                            "--prefill-buckets", "1x8", "--modes", "adaptive,adaptive_mixed,plain", "--json", str(out)])
    assert rc == 0
    adaptive, mixed, plain = json.loads(out.read_text())["results"]
    assert adaptive["phases"]["mixed"]["iters"] > 0 and mixed["phases"]["mixed"]["iters"] > 0
    assert adaptive["spec_calls_plain_for_prefill"] > 0
    assert mixed["spec_calls_plain_for_prefill"] == 0
    for r in (adaptive, mixed):
        assert r["generated_tokens"] == plain["generated_tokens"] == 3 * 12
