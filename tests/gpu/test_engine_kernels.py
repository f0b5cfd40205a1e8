"""The serving path runs the Triton kernels by default on a GPU (issue 19, "kernels in every entry point"): the
engine is built exactly as ``python -m dsflash.serve`` builds it from its default arguments (``--backend auto``),
its start-up compiles and one generate call are traced, and the Triton entry points must be reached from inside
those programs (trace-time call counts: a dispatch that silently fell back to XLA fails). The start-up line the
server logs must name the Triton kernels it compiled."""
import pytest

jax = pytest.importorskip("jax")

pytestmark = pytest.mark.gpu


def test_server_engine_defaults_run_the_triton_kernels(kernel_calls):
    from dsflash.serve.__main__ import build_parser, make_engine_factory
    from dsflash.serve.types import SamplingParams
    args = build_parser().parse_args(["--model", "tiny", "--max-model-len", "256", "--max-num-seqs", "4"])
    assert args.backend == "auto"
    engine = make_engine_factory(args)()
    line = engine.kernels_line
    print("start-up line:", line, "| traces:", kernel_calls)
    assert engine.run_options["backend"] == "triton"
    assert "moe decode=triton" in line and "mhc decode=triton" in line
    start_calls = dict(kernel_calls)
    assert start_calls["moe"] > 0 and start_calls["mhc"] > 0 and start_calls["indexer"] > 0
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine.add_request("a", [1, 5, 9, 42, 7] * 8, sp)
    engine.add_request("b", [3, 4, 5], sp)
    done = {}
    for _ in range(200):
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        if not engine.has_unfinished_requests():
            break
    assert sorted(done) == ["a", "b"]
    assert [len(done[r].outputs[0].token_ids) for r in ("a", "b")] == [12, 12]
    assert engine.compiles_after_warmup == 0
