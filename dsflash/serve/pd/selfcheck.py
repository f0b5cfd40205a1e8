"""``python -m dsflash.serve.pd.selfcheck``: the P/D data path in one process, on whatever device JAX has.

Builds an aggregated engine, a prefill ``PDEngine`` and a decode ``PDEngine``; for each prompt length runs
the prompt aggregated, then prefill (1 token, KV held) -> ``extract`` -> wire bytes (``pack``/``unpack``)
-> ``install`` on decode -> decode to the end, and checks the greedy outputs are identical. Prints (and
with ``--json`` writes) bytes moved per prompt token against the bound and the extract/install times. No
HTTP (runs where FastAPI is absent, e.g. the GPU machine); the HTTP path is ``tests/test_pd_disagg.py``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsflash.serve.pd.selfcheck")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--lens", default="5,64,130,1000", help="prompt lengths")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--decode-page-size", type=int, default=64, help="page size of the decode engine (the "
                    "transfer addresses entries by sequence position, so it may differ from the prefill side's 64)")
    ap.add_argument("--arrays", default="host", choices=["host", "device"],
                    help="host: through the HTTP wire bytes (pack/unpack); device: the transfer-server path's "
                         "device arrays (Layout.extract_device, padded) handed to install as they are")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)

    import jax
    import numpy as np

    from dsflash.serve.engine import LLMEngine
    from dsflash.serve.pd.engine import PDEngine
    from dsflash.serve.pd.transfer import TransferSize, pack, unpack
    from dsflash.serve.types import SamplingParams

    kw = dict(max_num_seqs=4, max_model_len=a.max_model_len)
    t0 = time.time()
    agg = LLMEngine(a.preset, **kw)
    pre = PDEngine(a.preset, pd_role="prefill", **kw)
    dec = PDEngine(a.preset, pd_role="decode", page_size=a.decode_page_size, **kw)
    print(f"engines up in {time.time() - t0:.1f}s on {jax.devices()[0].device_kind}", flush=True)

    def run(e, rid, ids, p):
        e.add_request(rid, ids, p)
        out = None
        while e.has_unfinished_requests():
            for o in e.step():
                if o.request_id == rid and o.finished:
                    out = o
        return out

    sizes = pre.pd_sizes
    rows, ok_all = [], True
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    for i, n in enumerate(int(x) for x in a.lens.split(",")):
        ids = [int(x) for x in np.random.default_rng(100 + i).integers(4, pre.backend.vocab_size - 12, size=n)]
        ref = run(agg, f"a{i}", ids, sp).outputs[0].token_ids
        pre.pd_hold.add(f"p{i}")
        run(pre, f"p{i}", ids, sp.replace(max_tokens=1))
        t1 = time.perf_counter()
        meta, arrays = pre.extract(f"p{i}", on_device=a.arrays == "device")
        if a.arrays == "device":
            jax.block_until_ready([x for _, x, _ in arrays])
            body, (meta2, arr2) = b"", (meta, arrays)
        else:
            body = pack(meta, arrays)
        t2 = time.perf_counter()
        if a.arrays == "host":
            meta2, arr2 = unpack(body)
        dec.pd_remote[f"d{i}"] = (meta2, arr2)
        t3 = time.perf_counter()
        dec.add_request(f"d{i}", ids, sp)
        dec.step()                                  # admission = install (+ first decode call)
        jax.block_until_ready(dec.runner.state)
        t4 = time.perf_counter()
        out = None
        while dec.has_unfinished_requests():
            for o in dec.step():
                if o.request_id == f"d{i}" and o.finished:
                    out = o
        got = out.outputs[0].token_ids
        pre.release(f"p{i}")
        sz = TransferSize.of(meta2, arr2, len(body))
        bound = sizes["global_kv_bytes_per_token"] * n + sizes["entry_bytes"] + sizes["window_bytes"]
        same = got == ref
        ok_all &= same and sz.global_bytes + sz.window_bytes <= bound
        rows.append({"prompt_tokens": n, "identical": same, "global_bytes": sz.global_bytes,
                     "window_bytes": sz.window_bytes, "wire_bytes": sz.wire_bytes,
                     "wire_bytes_per_token": sz.wire_bytes / n, "bound_bytes": bound,
                     "extract_pack_s": t2 - t1, "install_and_first_step_s": t4 - t3})
        print(json.dumps(rows[-1]), flush=True)
    res = {"device": str(jax.devices()[0].device_kind), "preset": a.preset, "sizes": sizes, "rows": rows,
           "ok": ok_all}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print("OK" if ok_all else "MISMATCH", flush=True)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
