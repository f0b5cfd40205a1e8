"""``python -m dsflash.bench serve``: a closed-loop serving benchmark against any OpenAI-compatible URL.

Concurrency = the number of live lanes (a lane is one closed-loop client: for the fixed workload a
stream of single requests, for the AgentX-like workload one session tree whose subagents may add
in-flight requests). Each lane warms up, all lanes meet at a barrier, and the profiling window runs
from the barrier until the run stops (``--duration`` seconds or ``--num-requests`` measured
requests, whichever first) and the measured requests in flight have drained. Requests stream over
SSE (httpx). Every number is per token (``serve_metrics``): the server's per-chunk usage
(``stream_options.continuous_usage_stats``) says how many tokens each chunk carries, else the
client's tokenizer counts them; with ``--tokenizer`` (default: the served dsflash model's) text
prompts are built to the exact server token count. A ``--sweep`` of concurrencies writes one
JSON file under ``benchmarks/results/`` and a PNG of output tokens/s/GPU against p90 interactivity.

Only the URL given by ``--base-url`` (default loopback) is ever contacted; proxies from the
environment are ignored and redirects are not followed.

Also runnable as ``python -m dsflash.bench.serve``.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as _dt
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

from dsflash.bench.serve_metrics import (
    DEFAULT_PERCENTILES, RequestRecord, compute_metrics, distribute_tokens, format_summary, parse_slos,
    throughput_at_interactivity)
from dsflash.bench.workloads import (
    AgentXConfig, AgentXWorkload, FixedConfig, FixedWorkload, PromptFitter, RequestSpec, StopLane, tokenish)

REPO_ROOT = Path(__file__).resolve().parents[2]
CLIENT_CPU_WARN = 0.7
_OVERFLOW_RE = re.compile(r"context length|context window|maximum context|max_model_len|too long|"
                          r"exceeds the model", re.I)


# ----------------------------------------------------------------------------------------------
# one streaming request
# ----------------------------------------------------------------------------------------------
class StreamingClient:
    """Sends a RequestSpec as a streaming chat/completions request and times every SSE chunk."""

    def __init__(self, base_url: str, model: str, *, api_key: Optional[str] = None, endpoint: str = "chat",
                 temperature: float = 0.0, ignore_eos: bool = True, extra_body: Optional[dict] = None,
                 request_timeout: float = 600.0, max_connections: int = 256, keep_text: bool = True,
                 continuous_usage: bool = True, tokenizer=None):
        import httpx  # lazily: the metric and workload modules need no HTTP stack
        self.base_url = base_url.rstrip("/")
        self.model, self.endpoint = model, endpoint
        self.temperature, self.ignore_eos = temperature, ignore_eos
        self.extra_body = dict(extra_body or {})
        self.keep_text = keep_text
        self.continuous_usage = continuous_usage   # ask for cumulative usage on every chunk (vLLM's option)
        self.tokenizer = tokenizer                 # counts chunk tokens when the server sends no per-chunk usage
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.http = httpx.AsyncClient(
            headers=headers, trust_env=False, follow_redirects=False,
            timeout=httpx.Timeout(request_timeout, connect=min(request_timeout, 30.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections))
        self._httpx = httpx

    async def aclose(self) -> None:
        await self.http.aclose()

    def payload(self, spec: RequestSpec) -> tuple[str, dict]:
        opts = {"include_usage": True}
        if self.continuous_usage:
            opts["continuous_usage_stats"] = True
        body: dict = {"model": self.model, "max_tokens": spec.max_tokens, "stream": True,
                      "stream_options": opts, "temperature": self.temperature}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "chat":
            body["messages"] = spec.as_messages()
            path = "/chat/completions"
        else:
            body["prompt"] = spec.as_prompt()
            path = "/completions"
        body.update(self.extra_body)
        return self.base_url + path, body

    async def run(self, spec: RequestSpec, request_id: str) -> RequestRecord:
        url, body = self.payload(spec)
        rec = RequestRecord(request_id=request_id, lane=spec.lane, session_id=spec.session_id, kind=spec.kind,
                            warmup=spec.warmup, max_tokens=spec.max_tokens, prompt_tokens=spec.est_prompt_tokens,
                            est_prompt_tokens=spec.est_prompt_tokens)
        texts: list[str] = []
        cums: list[Optional[int]] = []     # cumulative completion tokens reported with each content chunk
        n_ids = 0                          # token ids streamed so far (servers that return "token_ids")
        st = time.perf_counter()
        rec.start_time = st
        last = None
        done = False
        try:
            async with self.http.stream("POST", url, json=body) as resp:
                rec.status = resp.status_code
                if resp.status_code != 200:
                    raw = (await resp.aread()).decode("utf-8", "replace")
                    rec.error = f"HTTP {resp.status_code}: {_error_message(raw)}"
                    rec.context_overflow = resp.status_code in (400, 413, 422) and bool(_OVERFLOW_RE.search(raw))
                    return rec
                async for line in resp.aiter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data:"):
                        continue               # blank separators, ": comments", event: lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if obj.get("error"):
                        rec.error = f"stream error: {_error_message(json.dumps(obj))}"
                        rec.context_overflow = bool(_OVERFLOW_RE.search(json.dumps(obj)))
                        return rec
                    usage = obj.get("usage")
                    if usage:
                        _apply_usage(rec, usage)
                    text = _chunk_text(obj)
                    ids = _chunk_ids(obj)
                    if ids:
                        n_ids += len(ids)
                    if text or ids:       # a model without tokenizer streams token ids and no text
                        if last is None:
                            rec.ttft = now - st
                        else:
                            rec.chunk_gaps.append(now - last)
                        last = now
                        rec.num_chunks += 1
                        texts.append(text)
                        ct = usage.get("completion_tokens") if usage else None
                        if not isinstance(ct, (int, float)) and ids is not None:
                            ct = n_ids
                        cums.append(int(ct) if isinstance(ct, (int, float)) else None)
        except asyncio.CancelledError:
            rec.error = "cancelled (drain timeout)"
            rec.end_time = time.perf_counter()
            raise
        except self._httpx.TimeoutException as e:
            rec.error = f"timeout: {type(e).__name__}"
        except (self._httpx.HTTPError, OSError) as e:
            rec.error = f"connection error: {type(e).__name__}: {e}"
        except (json.JSONDecodeError, ValueError) as e:
            rec.error = f"bad SSE payload: {e}"
        finally:
            if not rec.end_time:
                rec.end_time = time.perf_counter()
        if rec.error:
            return rec
        if not done:
            rec.error = "stream ended without [DONE]"
            return rec
        if last is None:
            rec.error = "no tokens received"
            return rec
        rec.latency = last - st
        total = rec.output_tokens if rec.output_tokens_from_server else None
        rec.chunk_tokens, rec.chunk_tokens_source = chunk_token_counts_from_stream(
            texts, cums, total, self.tokenizer)
        if not rec.output_tokens_from_server:
            rec.output_tokens = sum(rec.chunk_tokens)
        if self.keep_text:
            rec.generated_text = "".join(texts)
        rec.success = True
        return rec


def chunk_token_counts_from_stream(texts: list[str], cums: list[Optional[int]], total: Optional[int],
                                   tokenizer=None) -> tuple[list[int], str]:
    """Tokens carried by each content chunk, and where the counts came from:

    * ``server``: every content chunk carried cumulative ``usage.completion_tokens``
      (``stream_options.continuous_usage_stats``); a chunk's tokens are the increase since the
      previous content chunk (tokens reported in content-free chunks go to the next content chunk,
      any after the last one to the last);
    * ``tokenizer``: the client's tokenizer counts each chunk's text, scaled to the server's total;
    * ``text-length``: no tokenizer: one token per chunk, and the rest of the server's total spread
      over the chunks by text length (exact when the total equals the number of chunks);
    * ``one-per-chunk``: neither per-chunk nor total counts: one token per chunk (vLLM's count).
    """
    if not texts:
        return [], ""
    if all(c is not None for c in cums):
        counts, prev = [], 0
        for c in cums:
            counts.append(max(c - prev, 0))
            prev = max(prev, c)
        if total is not None and total > prev:
            counts[-1] += total - prev
        return counts, "server"
    if tokenizer is not None:
        w = [len(tokenizer.encode(t)) for t in texts]
        return (w if total is None else distribute_tokens(total, w)), "tokenizer"
    if total is None:
        return [1] * len(texts), "one-per-chunk"
    k = len(texts)
    if total < k:
        return distribute_tokens(total, [len(t) for t in texts]), "text-length"
    # every content chunk carries at least one token; the rest goes by text length
    extra = distribute_tokens(total - k, [len(t) for t in texts])
    return [1 + e for e in extra], "text-length"


def _chunk_text(obj: dict) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:                                   # completions
        return c.get("text") or ""
    d = c.get("delta") or {}
    out = (d.get("content") or "") + (d.get("reasoning_content") or "") + (d.get("reasoning") or "")
    if not out and d.get("tool_calls"):
        out = json.dumps(d["tool_calls"])
    return out


def _chunk_ids(obj: dict) -> Optional[list]:
    """The chunk's ``token_ids`` (vLLM's ``return_token_ids``; a server without tokenizer), None if absent."""
    choices = obj.get("choices") or []
    ids = choices[0].get("token_ids") if choices else None
    return ids if isinstance(ids, list) else None


def _apply_usage(rec: RequestRecord, usage: dict) -> None:
    if usage.get("prompt_tokens") is not None:
        rec.prompt_tokens = int(usage["prompt_tokens"])
        rec.prompt_tokens_from_server = True
    if usage.get("completion_tokens") is not None:
        rec.output_tokens = int(usage["completion_tokens"])
        rec.output_tokens_from_server = True
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        rec.cached_tokens = int(details["cached_tokens"])


def _error_message(raw: str) -> str:
    try:
        obj = json.loads(raw)
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:300]
        return str(err)[:300]
    except (json.JSONDecodeError, AttributeError):
        return raw.strip()[:300]


# ----------------------------------------------------------------------------------------------
# one concurrency point
# ----------------------------------------------------------------------------------------------
class _Lane:
    """The LaneContext handed to a workload's driver."""

    def __init__(self, point: "PointRun", lane: int):
        self.point, self.lane = point, lane

    async def send(self, spec: RequestSpec) -> Optional[str]:
        p = self.point
        if p.stop.is_set():
            raise StopLane()
        spec.lane = self.lane
        if not spec.warmup:
            if p.budget is not None and p.issued >= p.budget:
                p.stop.set()
                raise StopLane()
            p.issued += 1
        p.in_flight += 1
        p.seq += 1
        st = time.perf_counter()
        try:
            rec = await p.client.run(spec, request_id=f"{p.tag}-{p.seq}")
        except asyncio.CancelledError:
            # cut off at the end of the drain: a failure (the record never came back)
            p.records.append(RequestRecord(request_id=f"{p.tag}-{p.seq}", lane=self.lane, session_id=spec.session_id,
                                           kind=spec.kind, warmup=spec.warmup, start_time=st,
                                           end_time=time.perf_counter(), max_tokens=spec.max_tokens,
                                           error="cancelled: still running at the end of the drain timeout"))
            raise
        finally:
            p.in_flight -= 1
        p.records.append(rec)
        if not rec.success and p.verbose:
            print(f"  request failed ({spec.kind}, lane {self.lane}): {rec.error}", file=sys.stderr)
        return rec.generated_text if rec.success else None

    async def think(self, seconds: float) -> None:
        p = self.point
        if seconds > 0:
            try:
                await asyncio.wait_for(p.stop.wait(), timeout=seconds)
            except asyncio.TimeoutError:
                pass
        if p.stop.is_set():
            raise StopLane()

    async def warmup_done(self) -> None:
        p = self.point
        p.lane_warm(self.lane)
        await p.profile_open.wait()
        if p.stop.is_set():
            raise StopLane()


class PointRun:
    def __init__(self, workload, client: StreamingClient, concurrency: int, *, budget: Optional[int],
                 duration: Optional[float], warmup_timeout: float, drain_timeout: float, tag: str = "",
                 verbose: bool = False):
        self.workload, self.client, self.concurrency = workload, client, concurrency
        self.budget, self.duration = budget, duration
        self.warmup_timeout, self.drain_timeout = warmup_timeout, drain_timeout
        self.tag, self.verbose = tag, verbose
        self.records: list[RequestRecord] = []
        self.issued = 0
        self.seq = 0
        self.in_flight = 0
        self.warm_lanes: set[int] = set()
        self.lane_errors: list[str] = []

    def lane_warm(self, lane: int) -> None:
        self.warm_lanes.add(lane)
        if len(self.warm_lanes) >= self.concurrency:
            self.all_warm.set()

    async def _lane_main(self, i: int) -> None:
        try:
            await self.workload.run_lane(_Lane(self, i))
        except StopLane:
            pass
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a workload bug must not hang the run
            self.lane_errors.append(f"lane {i}: {type(e).__name__}: {e}")
            self.lane_warm(i)         # never block the barrier on a dead lane

    async def run(self) -> dict:
        self.stop = asyncio.Event()
        self.all_warm = asyncio.Event()
        self.profile_open = asyncio.Event()
        t_begin = time.perf_counter()
        tasks = [asyncio.create_task(self._lane_main(i)) for i in range(self.concurrency)]
        notes: list[str] = []
        try:
            await asyncio.wait_for(self.all_warm.wait(), timeout=self.warmup_timeout)
        except asyncio.TimeoutError:
            notes.append(f"warm-up did not finish within {self.warmup_timeout:g} s")
            self.stop.set()
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        self.profile_open.set()
        if not self.stop.is_set():
            deadline = None if self.duration is None else t0 + self.duration
            while not self.stop.is_set() and not all(t.done() for t in tasks):
                if deadline is not None and time.perf_counter() >= deadline:
                    break
                await asyncio.sleep(0.01)
        self.stop.set()
        t_stop = time.perf_counter()
        _, pending = await asyncio.wait(tasks, timeout=self.drain_timeout)
        if pending:
            notes.append(f"{len(pending)} lane(s) still busy after the {self.drain_timeout:g} s drain; cancelled")
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        measured = [r for r in self.records if not r.warmup]
        ends = [r.end_time for r in measured if r.end_time]
        t_end = max(ends) if ends else time.perf_counter()
        # the client's own CPU use over the window: near one core means the client, not the
        # server, may be what limits the numbers (one Python event loop parses every chunk)
        cpu_frac = (time.process_time() - cpu0) / max(time.perf_counter() - t0, 1e-9)
        return {
            "records": self.records,
            "window_start": t0,
            "window_end": max(t_end, t0 + 1e-9),
            "warmup_s": t0 - t_begin,
            "stop_s": t_stop - t0,
            "drain_s": time.perf_counter() - t_stop,
            "cancelled_lanes": len(pending),
            "client_cpu_fraction": cpu_frac,
            "notes": notes + self.lane_errors,
        }


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
_AGENTX_HELP = {
    "system_tokens": "system prompt + tools, shared by a root and its subagents",
    "first_turn_tokens": "first user message (task, files)",
    "turn_tokens": "median new tokens per later turn (tool results; lognormal)",
    "turn_sigma": "lognormal sigma of the new tokens per turn",
    "output_tokens": "median output tokens per request (lognormal)",
    "output_sigma": "lognormal sigma of output tokens",
    "min_output_tokens": "output tokens lower clip",
    "max_output_tokens": "output tokens upper clip",
    "min_turns": "root turns per session, lower bound",
    "max_turns": "root turns per session, upper bound",
    "think_time": "mean seconds between an answer and the next request (exponential)",
    "max_think_time": "cap on one think-time gap, seconds",
    "subagent_prob": "probability that a root turn fans out to subagents",
    "max_fanout": "subagents per fan-out, uniform in 1..N (<= 10)",
    "subagent_min_turns": "turns per subagent, lower bound",
    "subagent_max_turns": "turns per subagent, upper bound",
    "subagent_task_tokens": "first message of a subagent",
    "subagent_result_tokens": "tokens each subagent result adds to the root context",
    "max_context_tokens": "a session ends before its context would exceed this",
    "scale": "multiplies the input token lengths above, not outputs (e.g. 16 for AgentX-sized contexts)",
    "history": "actual: send back the server's answers; synthetic: planned text (server-independent)",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dsflash.bench serve",
        description="Closed-loop serving benchmark (TTFT/TPOT/ITL/E2EL per token, vLLM/AIPerf definitions) against an "
                    "OpenAI-compatible server. See docs/benchmarks.md.")
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                   help="OpenAI-compatible base URL, including /v1 (default %(default)s)")
    g.add_argument("--model", default=None, help="model name (default: the first from GET /models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY if set)")
    g.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (output lengths then depend on the model)")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--no-continuous-usage", dest="continuous_usage", action="store_false",
                   help="do not send stream_options.continuous_usage_stats (per-chunk token counts, as vLLM and "
                        "dsflash support; strict OpenAI servers reject it); chunk tokens are then counted with "
                        "--tokenizer or estimated")

    g = p.add_argument_group("load")
    g.add_argument("--concurrency", type=int, default=4, help="live lanes (session trees) (default %(default)s)")
    g.add_argument("--sweep", default=None, help="comma-separated concurrencies, e.g. 1,2,4,8 (overrides --concurrency)")
    g.add_argument("--num-requests", type=int, default=None,
                   help="measured requests per point (default 10 x concurrency unless --duration is given)")
    g.add_argument("--duration", type=float, default=None, help="profiling window per point, seconds")
    g.add_argument("--warmup-timeout", type=float, default=600.0)
    g.add_argument("--drain-timeout", type=float, default=120.0,
                   help="after the stop, seconds to let in-flight requests finish (then cancelled, counted failed)")
    g.add_argument("--repeats", type=int, default=1, help="repetitions per concurrency (report median and spread)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--nonce", default=None,
                   help="cache-busting nonce (default: random per run); lengths depend only on --seed")

    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=("fixed", "agentx"), default="fixed")
    g.add_argument("--warmup-requests", type=int, default=None,
                   help="warm-up requests per lane (fixed: default 1; agentx: root turns after the primer, default 2)")
    g.add_argument("--input-len", type=int, default=1024, help="fixed: prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="fixed: output tokens")
    g.add_argument("--range-ratio", type=float, default=0.0, help="fixed: lengths uniform in len*(1±r)")
    g.add_argument("--prefix-len", type=int, default=0, help="fixed: tokens of a prefix shared by all requests")
    g.add_argument("--prompt-format", choices=("text", "token-ids"), default="text",
                   help="fixed: token-ids sends random ids (exact lengths; --endpoint completions)")
    g.add_argument("--vocab-size", type=int, default=1000, help="fixed + token-ids: ids drawn from [10, V)")
    g.add_argument("--tokenizer", default="auto",
                   help="client tokenizer (folder with tokenizer.json, or the file; 'none' for none). With it, "
                        "--input-len prompts are built to the exact server token count (the server's overhead "
                        "measured by two probes) and chunk tokens are counted when the server sends no per-chunk "
                        "usage. Default 'auto': the served model's tokenizer when it ships with dsflash")
    g.add_argument("--tokens-per-word", type=float, default=None,
                   help="server tokens per prompt word; default: measured with two 1-token probe requests "
                        "before the run (so token lengths are the server's), 1.0 if the server reports no usage")
    d = AgentXConfig()
    for f in dataclasses.fields(AgentXConfig):
        if f.name in ("warmup_requests",):
            continue
        flag = "--agentx-" + f.name.replace("_", "-")
        typ = type(getattr(d, f.name))
        kw = ({"choices": ("actual", "synthetic")} if f.name == "history"
              else {"type": typ, "metavar": "N" if typ is int else "X"})
        g.add_argument(flag, dest="agentx_" + f.name, default=getattr(d, f.name),
                       help=f"agentx: {_AGENTX_HELP[f.name]} (default %(default)s)", **kw)

    g = p.add_argument_group("reporting")
    g.add_argument("--num-gpus", type=int, default=1, help="GPUs behind the URL (prefill + decode) for per-GPU rates")
    g.add_argument("--gpu-hour-usd", type=float, default=None, help="$/GPU-hour for cost per million tokens")
    g.add_argument("--slo", default=None, help="goodput SLOs in ms, e.g. ttft=2000,tpot=50 (also e2el; itl = largest per-token ITL; icl = largest chunk gap)")
    g.add_argument("--percentiles", default=",".join(f"{p:g}" for p in DEFAULT_PERCENTILES),
                   help="latency percentiles (p90 is always included)")
    g.add_argument("--at-interactivity", default="20,50",
                   help="p90 interactivity targets (tok/s/user) at which to read output tok/s/GPU off the sweep's "
                        "Pareto front by monotone interpolation (default %(default)s)")
    g.add_argument("--compare", nargs=2, metavar=("BASE.json", "NEW.json"), default=None,
                   help="run nothing: print NEW / BASE output tok/s/GPU ratios at the --at-interactivity targets")
    g.add_argument("--label", default=None, help="result label (default: <workload>)")
    g.add_argument("--device", default="", help="free-text description of the server hardware, recorded in the JSON")
    g.add_argument("--out-dir", default=str(REPO_ROOT / "benchmarks" / "results"))
    g.add_argument("--no-save", action="store_true", help="print only; write no JSON / PNG")
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--save-requests", action="store_true", help="include every request record in the JSON")
    g.add_argument("--verbose", action="store_true")
    return p


def _agentx_config(args) -> AgentXConfig:
    kw = {f.name: getattr(args, "agentx_" + f.name) for f in dataclasses.fields(AgentXConfig)
          if f.name != "warmup_requests"}
    if args.warmup_requests is not None:
        kw["warmup_requests"] = args.warmup_requests
    return AgentXConfig(**kw)


def make_workload(args, nonce: str, tokens_per_word: float = 1.0, fitter: Optional[PromptFitter] = None,
                  prompt_overhead: Optional[int] = None):
    if args.workload == "fixed":
        cfg = FixedConfig(input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                          prefix_len=args.prefix_len, prompt_format=args.prompt_format, vocab_size=args.vocab_size,
                          warmup_requests=1 if args.warmup_requests is None else args.warmup_requests)
        return (FixedWorkload(cfg, seed=args.seed, nonce=nonce, endpoint=args.endpoint,
                              tokens_per_word=tokens_per_word, fitter=fitter, prompt_overhead=prompt_overhead),
                dataclasses.asdict(cfg))
    if args.endpoint != "chat":
        raise ValueError("the agentx workload needs --endpoint chat")
    cfg = _agentx_config(args)
    return AgentXWorkload(cfg, seed=args.seed, nonce=nonce, tokens_per_word=tokens_per_word), dataclasses.asdict(cfg)


PROBE_WORDS = (32, 128)
PROBE_TOKENS = (32, 128)


def resolve_tokenizer(spec: Optional[str], model_id: str = ""):
    """The client-side tokenizer: ``none`` -> None; a folder with ``tokenizer.json`` (or the file)
    -> that; ``auto`` -> the tokenizer of the served model when it is a dsflash model shipped in
    this checkout (``dsflash/assets/<model>``) or a local folder of that name, else None.
    Returns (tokenizer or None, a note saying which)."""
    spec = (spec or "auto").strip()
    if spec.lower() == "none":
        return None, "none (--tokenizer none)"
    cands = [spec] if spec.lower() != "auto" else [
        str(REPO_ROOT / "dsflash" / "assets" / model_id) if model_id and "/" not in model_id else "", model_id]
    for c in cands:
        if not c:
            continue
        f = Path(c) / "tokenizer.json" if Path(c).is_dir() else Path(c)
        if f.is_file():
            from dsflash.tokenizer import Tokenizer
            try:
                return Tokenizer.from_folder(str(f)), str(f)
            except Exception as e:  # noqa: BLE001 - a broken file: say so, run without
                if spec.lower() != "auto":
                    raise ValueError(f"--tokenizer {spec}: {type(e).__name__}: {e}") from None
                return None, f"none ({f}: {type(e).__name__}: {e})"
    if spec.lower() != "auto":
        raise ValueError(f"--tokenizer {spec}: no tokenizer.json there")
    return None, f"none (no local tokenizer for model {model_id!r}; pass --tokenizer PATH)"


async def calibrate_prompt_overhead(client: "StreamingClient", fitter: PromptFitter,
                                    nonce: str) -> tuple[Optional[int], str]:
    """The tokens the server adds around a prompt (BOS, chat template), from the usage of two
    1-token probes whose texts are exactly 32 and 128 tokens under the client's tokenizer. Both
    probes must give the same overhead (else the client's tokenizer is not the server's). Returns
    (overhead, note), or (None, why not)."""
    import numpy as np
    got = []
    for i, n in enumerate(PROBE_TOKENS):
        text = fitter.fit(np.random.default_rng(2000 + i), n)
        spec = RequestSpec(max_tokens=1, kind="probe", warmup=True,
                           **({"messages": [{"role": "user", "content": text}]} if client.endpoint == "chat"
                              else {"prompt": text}))
        rec = await client.run(spec, request_id=f"probe-len-{i}")
        if not rec.success:
            return None, f"length probe failed ({rec.error})"
        if not rec.prompt_tokens_from_server:
            return None, "the server reports no usage.prompt_tokens"
        got.append(rec.prompt_tokens - n)
    if got[0] != got[1] or got[0] < 0:
        return None, (f"the client's tokenizer does not count like the server (overheads {got} for "
                      f"{list(PROBE_TOKENS)}-token probes)")
    return got[0], (f"exact: the server adds {got[0]} tokens around a prompt (probes of "
                    f"{list(PROBE_TOKENS)} tokens)")


async def calibrate_tokens_per_word(client: "StreamingClient", nonce: str) -> tuple[float, str]:
    """Server tokens per token-ish word, from the usage of two 1-token requests of different
    lengths (the difference cancels the chat template's fixed overhead). Returns (1.0, reason)
    when the server does not report usage or a probe fails."""
    import numpy as np
    counts = []
    for i, n in enumerate(PROBE_WORDS):
        text = f"[probe {nonce}-{i}] " + tokenish(np.random.default_rng(1000 + i), n)
        spec = RequestSpec(max_tokens=1, kind="probe", warmup=True,
                           **({"messages": [{"role": "user", "content": text}]} if client.endpoint == "chat"
                              else {"prompt": text}))
        rec = await client.run(spec, request_id=f"probe-{i}")
        if not rec.success:
            return 1.0, f"probe request failed ({rec.error}); assuming 1 token per word"
        if not rec.prompt_tokens_from_server:
            return 1.0, "the server reports no usage.prompt_tokens; assuming 1 token per word"
        counts.append(rec.prompt_tokens)
    tpw = (counts[1] - counts[0]) / (PROBE_WORDS[1] - PROBE_WORDS[0])
    if not tpw > 0:
        return 1.0, f"probe token counts {counts} make no sense; assuming 1 token per word"
    return tpw, f"measured {tpw:.3f} server tokens per prompt word (probes: {counts} tokens)"


def git_commit() -> dict:
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": "unknown", "dirty": None}
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}


async def _discover_model(base_url: str, api_key: Optional[str], timeout: float) -> str:
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=timeout) as c:
        r = await c.get(base_url.rstrip("/") + "/models", headers=headers)
        r.raise_for_status()
        data = r.json().get("data") or []
        if not data:
            raise RuntimeError(f"{base_url}/models lists no model; pass --model")
        return data[0]["id"]


_HEADLINE = ("output_throughput_per_gpu", "total_token_throughput_per_gpu", "p90_interactivity",
             "request_throughput", "goodput", "usd_per_million_output_tokens")


def _summarise(reps: list[dict]) -> dict:
    """Median and spread over repetitions of the headline numbers and the p90 latencies."""
    import numpy as np
    out: dict = {}

    def put(name, vals):
        vals = [v for v in vals if v is not None]
        if vals:
            out[name] = {"median": float(np.median(vals)), "min": float(min(vals)), "max": float(max(vals))}
    for k in _HEADLINE:
        put(k, [r["metrics"].get(k) for r in reps])
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "icl_ms", "e2el_ms"):
        put(k[:-3] + "_p90_ms", [r["metrics"][k]["p90"] for r in reps])
    out["valid"] = all(r["metrics"]["valid"] for r in reps)
    return out


async def run_benchmark(args) -> dict:
    if args.sweep:
        concurrencies = [int(x) for x in args.sweep.split(",") if x.strip()]
    else:
        concurrencies = [args.concurrency]
    if not concurrencies or min(concurrencies) < 1:
        raise SystemExit("concurrency values must be >= 1")
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    percentiles = [float(x) for x in args.percentiles.split(",") if x.strip()]
    slos = parse_slos(args.slo)
    extra = json.loads(args.extra_body) if args.extra_body else None
    if extra is not None and not isinstance(extra, dict):
        raise SystemExit("--extra-body must be a JSON object")
    model = args.model or await _discover_model(args.base_url, args.api_key, min(args.request_timeout, 30.0))
    base_nonce = args.nonce or uuid.uuid4().hex[:8]
    _, wl_config = make_workload(args, base_nonce)   # validates the workload flags before any load
    tokenizer, tok_note = resolve_tokenizer(args.tokenizer, model)
    fitter = PromptFitter(tokenizer) if tokenizer is not None else None
    overhead, len_note = None, "estimated (no client tokenizer)" if fitter is None else ""

    def probe_client():
        return StreamingClient(args.base_url, model, api_key=args.api_key, endpoint=args.endpoint,
                               temperature=args.temperature, ignore_eos=args.ignore_eos, extra_body=extra,
                               request_timeout=args.request_timeout, continuous_usage=args.continuous_usage)
    if args.prompt_format == "token-ids":
        len_note = "exact (token-id prompts)"
    elif fitter is not None and args.workload == "fixed":
        probe = probe_client()
        try:
            overhead, len_note = await calibrate_prompt_overhead(probe, fitter, base_nonce)
        finally:
            await probe.aclose()
        if overhead is None:
            len_note = "estimated: " + len_note
        print(f"bench serve: prompt lengths {len_note}")
    elif fitter is not None:
        len_note = "estimated (agentx: chat overhead per message estimated)"
    tpw, tpw_note = args.tokens_per_word, "given by --tokens-per-word"
    if args.prompt_format == "token-ids":
        tpw, tpw_note = 1.0, "not used (token-id prompts have exact lengths)"
    elif overhead is not None:
        tpw, tpw_note = 1.0, "not used (prompts built with the tokenizer to exact lengths)"
    if tpw is None and args.prompt_format == "text":
        probe = probe_client()
        try:
            tpw, tpw_note = await calibrate_tokens_per_word(probe, base_nonce)
        finally:
            await probe.aclose()
        print(f"bench serve: {tpw_note}")
    tpw = tpw or 1.0
    exact = args.prompt_format == "token-ids" or overhead is not None
    fanout = args.agentx_max_fanout if args.workload == "agentx" else 0
    label = args.label or args.workload
    result: dict = {
        "benchmark": "serve",
        "label": label,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **git_commit(),
        "device": args.device,
        "config": {
            "base_url": args.base_url, "model": model, "endpoint": args.endpoint, "workload": args.workload,
            "workload_config": wl_config, "concurrencies": concurrencies, "repeats": args.repeats,
            "num_requests": args.num_requests, "duration": args.duration, "seed": args.seed, "nonce": base_nonce,
            "temperature": args.temperature, "ignore_eos": args.ignore_eos, "extra_body": extra,
            "num_gpus": args.num_gpus, "gpu_hour_usd": args.gpu_hour_usd, "slos_ms": {k: v * 1e3 for k, v in slos.items()},
            "percentiles": percentiles, "tokens_per_word": tpw, "tokens_per_word_note": tpw_note,
            "tokenizer": tok_note, "prompt_lengths": len_note, "prompt_overhead_tokens": overhead,
            "continuous_usage_stats": args.continuous_usage,
        },
        "points": [],
    }
    result["config_hash"] = hashlib.sha256(
        json.dumps({k: v for k, v in result["config"].items() if k != "nonce"}, sort_keys=True).encode()).hexdigest()[:12]
    for conc in concurrencies:
        reps = []
        for rep in range(args.repeats):
            nonce = f"{base_nonce}c{conc}r{rep}"        # fresh cache-busting markers per point
            workload, _ = make_workload(args, nonce, tpw, fitter=fitter, prompt_overhead=overhead)
            budget = args.num_requests
            if budget is None and args.duration is None:
                budget = 10 * conc
            client = StreamingClient(args.base_url, model, api_key=args.api_key, endpoint=args.endpoint,
                                     temperature=args.temperature, ignore_eos=args.ignore_eos, extra_body=extra,
                                     request_timeout=args.request_timeout,
                                     max_connections=max(64, conc * (1 + fanout) + 8),
                                     keep_text=(args.workload == "agentx"), continuous_usage=args.continuous_usage,
                                     tokenizer=tokenizer)
            try:
                run = PointRun(workload, client, conc, budget=budget, duration=args.duration,
                               warmup_timeout=args.warmup_timeout, drain_timeout=args.drain_timeout,
                               tag=f"c{conc}r{rep}", verbose=args.verbose)
                out = await run.run()
            finally:
                await client.aclose()
            records = out["records"]
            metrics = compute_metrics(records, out["window_end"] - out["window_start"], percentiles=percentiles,
                                      slos=slos, num_gpus=args.num_gpus, gpu_hour_usd=args.gpu_hour_usd)
            if out["notes"]:
                metrics["valid"] = False
                metrics["invalid_reasons"] += out["notes"]
            if out["client_cpu_fraction"] > CLIENT_CPU_WARN:
                print(f"bench serve: warning: the client used {out['client_cpu_fraction']:.0%} of a CPU core "
                      f"during the window at concurrency {conc}; it may be limiting the measurement",
                      file=sys.stderr)
            measured = [r for r in records if not r.warmup]
            entry = {
                "concurrency": conc, "repeat": rep, "metrics": metrics,
                "warmup_requests": len(records) - len(measured), "warmup_s": out["warmup_s"],
                "drain_s": out["drain_s"], "notes": out["notes"],
                "client_cpu_fraction": out["client_cpu_fraction"],
                "requests_by_kind": _count(r.kind for r in measured),
                "output_len_mismatch": sum(1 for r in measured if r.success and args.ignore_eos
                                           and r.output_tokens != r.max_tokens),
                "prompt_tokens_vs_estimate": _ratio([r for r in measured if r.success and r.prompt_tokens_from_server]),
                # exact lengths: requests whose server-counted prompt differs from the length built
                "prompt_len_mismatch": (sum(1 for r in measured if r.success and r.prompt_tokens_from_server
                                            and r.prompt_tokens != r.est_prompt_tokens) if exact else None),
            }
            if args.save_requests:
                entry["requests"] = [dict(r.to_json(), start_time=r.start_time - out["window_start"],
                                          end_time=r.end_time - out["window_start"]) for r in records]
            reps.append(entry)
            result["points"].append(entry)
            print(format_summary(metrics, f"concurrency {conc}" + (f" rep {rep}" if args.repeats > 1 else "")))
            sys.stdout.flush()
        result.setdefault("summary", []).append({"concurrency": conc, **_summarise(reps)})
    result["valid"] = all(s["valid"] for s in result["summary"])
    result["output_throughput_per_gpu_at_p90_interactivity"] = sweep_at_interactivity(
        result, _targets(args.at_interactivity))
    return result


def _targets(spec: str) -> list[float]:
    return [float(x) for x in spec.split(",") if x.strip()]


def sweep_at_interactivity(result: dict, targets: list[float]) -> dict:
    """Output tok/s/GPU at fixed p90 interactivity from a result's valid sweep points (medians)."""
    pts = [(s["p90_interactivity"]["median"], s["output_throughput_per_gpu"]["median"])
           for s in result.get("summary", []) if s.get("valid") and "p90_interactivity" in s
           and "output_throughput_per_gpu" in s]
    return throughput_at_interactivity(pts, targets)


def compare_results(base_path: str, new_path: str, targets: list[float]) -> str:
    base, new = (json.loads(Path(p).read_text()) for p in (base_path, new_path))
    a, b = sweep_at_interactivity(base, targets), sweep_at_interactivity(new, targets)
    lines = [f"output tok/s/GPU at fixed p90 interactivity: {new.get('label')} ({str(new.get('commit'))[:10]}) "
             f"vs {base.get('label')} ({str(base.get('commit'))[:10]})"]
    for k in a:
        ratio = (b[k] / a[k]) if a[k] and b[k] is not None else None
        lines.append(f"  {k:>6} tok/s/user: base {_fmt(a[k])}  new {_fmt(b[k])}  ratio "
                     + (f"{ratio:.3f}" if ratio is not None else "n/a (outside a measured range)"))
    return "\n".join(lines)


def _fmt(v) -> str:
    return f"{v:10.2f}" if v is not None else "       n/a"


def _ratio(recs) -> Optional[float]:
    est = sum(r.est_prompt_tokens for r in recs)
    return sum(r.prompt_tokens for r in recs) / est if est else None


def _count(it) -> dict:
    out: dict = {}
    for k in it:
        out[k] = out.get(k, 0) + 1
    return out


def save_results(result: dict, out_dir: str, plot: bool = True) -> tuple[Path, Optional[Path]]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", result["label"]).strip("-") or "run"
    stem = out / f"serve_{stamp}_{safe}"
    png = None
    if plot:
        from dsflash.bench.plots import plot_serve_sweep
        png = plot_serve_sweep(result, stem.with_suffix(".png"))
        result["plot"] = str(png) if png else None
    json_path = stem.with_suffix(".json")
    json_path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    return json_path, png


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.compare:
        try:
            print(compare_results(*args.compare, _targets(args.at_interactivity)))
        except (OSError, ValueError, KeyError) as e:
            print(f"bench serve: error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        result = asyncio.run(run_benchmark(args))
    except (ValueError, RuntimeError) as e:
        print(f"bench serve: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # e.g. the server is not there
        print(f"bench serve: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    at = result["output_throughput_per_gpu_at_p90_interactivity"]
    print("output tok/s/GPU at p90 interactivity: "
          + ", ".join(f"{k} tok/s/user -> {_fmt(v).strip()}" for k, v in at.items()))
    if not args.no_save:
        json_path, png = save_results(result, args.out_dir, plot=not args.no_plot)
        print(f"results: {json_path}" + (f"\nplot:    {png}" if png else ""))
    if not result["valid"]:
        print("bench serve: at least one point is INVALID (see invalid_reasons)", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
