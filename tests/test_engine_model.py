"""The engine on the real tiny model (random weights, reference numerics).

Compile-heavy (two decode programs and one shared prefill bucket): every claim that needs the real
model is checked on the same two engines."""
import numpy as np
import pytest

from dsflash.serve.engine import LLMEngine
from dsflash.serve.engine.backend import ModelBackend
from dsflash.serve.types import SamplingParams
from test_engine_scheduler import run_all  # one helper: drives a continuous batch, checks no compile / no leak

OPTS = dict(max_num_seqs=4, max_model_len=96, page_size=16, max_num_batched_tokens=64, decode_steps=2,
            prefill_buckets=[(2, 32)])


@pytest.fixture(scope="module")
def model():
    # dsflash.load("tiny") with numpy-initialised weights (init_params takes ~20 s on 2 cores)
    from dsflash.checkpoint.synth import fast_init_params
    from dsflash.config import preset
    from dsflash.api import Model, _synthetic_tokenizer
    cfg = preset("tiny")
    return Model(cfg, fast_init_params(cfg, 0), _synthetic_tokenizer(cfg), name="tiny")


@pytest.fixture(scope="module")
def spec_engine(model):
    return LLMEngine(ModelBackend(model), speculative=True, speculative_mode="always", async_scheduling=True, **OPTS)


@pytest.fixture(scope="module")
def plain_engine(model):
    return LLMEngine(ModelBackend(model), speculative=False, async_scheduling=False, **OPTS)


def prompts(n, seed, lo, hi, V=512):
    r = np.random.default_rng(seed)
    return [[int(x) for x in r.integers(4, V, size=int(r.integers(lo, hi)))] for _ in range(n)]


def test_real_model_greedy_speculative_equals_plain(spec_engine, plain_engine):
    ps = prompts(8, seed=0, lo=3, hi=70)                     # prompts over 32 tokens are chunked
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    items = [(f"g{i}", p, sp) for i, p in enumerate(ps)]
    a = run_all(plain_engine, items)
    b = run_all(spec_engine, items)
    for rid in a:
        assert a[rid].outputs[0].token_ids == b[rid].outputs[0].token_ids, rid
    m = spec_engine.metrics_snapshot()
    assert m["spec_num_drafts"] > 0 and m["spec_num_draft_tokens"] == m["spec_num_drafts"] * spec_engine.k
    assert spec_engine.memory["global_kv_bytes_per_token"] > 0


def test_real_model_seed_independent_of_batch(spec_engine):
    ps = prompts(3, seed=1, lo=5, hi=30)
    sp = SamplingParams(max_tokens=6, temperature=1.0, top_k=50, seed=99, ignore_eos=True)
    alone = run_all(spec_engine, [("a", ps[0], sp)])["a"].outputs[0].token_ids
    other = SamplingParams(max_tokens=6, temperature=0.7, seed=5)
    batched = run_all(spec_engine, [("x", ps[1], other), ("b", ps[0], sp), ("y", ps[2], other)])["b"]
    assert batched.outputs[0].token_ids == alone


def test_real_model_prefix_cache(spec_engine):
    eng = spec_engine
    base = prompts(1, seed=2, lo=48, hi=49)[0]                 # 3 full pages
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eng.reset_prefix_cache()
    miss = run_all(eng, [("m", base + [7, 8], sp)])["m"].outputs[0].token_ids
    eng.prefix_cache_mode = "replay"          # the replays themselves (exact mode: tests/test_engine_prefix_exact.py)
    for mode in ("exact", "bounded"):
        eng.prefix_replay = mode
        eng.reset_prefix_cache()
        run_all(eng, [(f"w-{mode}", base + [9], sp)])
        h0 = eng.metrics.prefix_hit_tokens
        hit = run_all(eng, [(f"h-{mode}", base + [7, 8], sp)])[f"h-{mode}"]
        assert eng.metrics.prefix_hit_tokens - h0 == 48 and hit.metrics.num_cached_tokens == 48
        if mode == "exact":
            assert hit.outputs[0].token_ids == miss
        else:   # SPEC §6.1 bounded replay is an approximation: same length, reported agreement only
            assert len(hit.outputs[0].token_ids) == len(miss)
    eng.prefix_replay = "bounded"
    eng.prefix_cache_mode = "exact"


def test_real_model_text_api_stop_strings_and_chat(spec_engine):
    from dsflash.llm import LLM
    llm = LLM.from_engine(spec_engine)
    tok = llm.tokenizer
    assert tok is not None
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate(["hello world", "a b c"], sp)
    o = out[0].outputs[0]
    assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
    assert out[0].prompt == "hello world" and out[0].prompt_token_ids == [tok.bos_id] + tok.encode("hello world")
    # a stop string taken from the free-running text ends generation there
    if len(o.text) > 2:
        stop = o.text[1:3]
        s2 = llm.generate("hello world", sp.replace(stop=[stop]))[0].outputs[0]
        assert s2.finish_reason == "stop" and s2.stop_reason == stop
        assert s2.text == o.text[:o.text.index(stop)]
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0.0))
    assert chat[0].outputs[0].token_ids and len(chat[0].outputs[0].token_ids) <= 4
    assert spec_engine.compiles_after_warmup == 0


class OracleDraftBackend(ModelBackend):
    """The real target model with drafts read from a table of the expected greedy sequence per slot
    (``params["engine_test.oracle"]`` [slots, len]), every draft at a position divisible by 3 corrupted:
    verification then accepts some drafts and rejects others, exercising rollback of the real caches."""

    def propose(self, params, state, y, pos, slots, floor, temperature, keys):
        import jax.numpy as jnp
        table = params["engine_test.oracle"]
        q = pos[:, None] + 2 + jnp.arange(self.block)[None]
        d = table[slots[:, None], jnp.clip(q, 0, table.shape[1] - 1)]
        d = jnp.where(q % 3 == 0, (d + 1) % self.vocab_size, d).astype(jnp.int32)
        logits = jnp.where(jnp.arange(self.vocab_size) == d[..., None], 0.0, -jnp.inf)
        return d, logits, jnp.zeros(d.shape, jnp.float32)


@pytest.mark.slow
def test_real_model_partially_accepted_drafts_equal_plain(model, plain_engine):
    import jax.numpy as jnp
    be = OracleDraftBackend(model)
    be.params = dict(be.params, **{"engine_test.oracle": jnp.zeros((OPTS["max_num_seqs"], 128), jnp.int32)})
    eng = LLMEngine(be, speculative=True, speculative_mode="always", **OPTS)
    ps = prompts(4, seed=4, lo=5, hi=60)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = run_all(plain_engine, [(f"q{i}", p, sp) for i, p in enumerate(ps)])
    table = np.zeros((OPTS["max_num_seqs"], 128), np.int32)
    for i, p in enumerate(ps):                      # a fresh engine gives request i slot i
        full = p + want[f"q{i}"].outputs[0].token_ids
        table[i, :len(full)] = full
    eng.runner.params = dict(eng.runner.params, **{"engine_test.oracle": jnp.asarray(table)})
    got = run_all(eng, [(f"q{i}", p, sp) for i, p in enumerate(ps)])
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
    m = eng.metrics_snapshot()
    assert 0 < m["spec_acceptance_rate"] < 1 and m["spec_mean_acceptance_length"] > 1.3
