"""A model-free engine with the ``LLMEngine`` interface, for exercising the HTTP layer.

``python -m dsflash.serve --model dummy`` serves it: it starts in about a second, uses the tiny
preset's synthetic tokenizer, and "generates" pseudo-random tokens (a seeded ``random.Random`` per
request, so ``seed`` reproducibility holds) while honouring ``max_tokens``, stop strings, stop token
ids, ``ignore_eos``, ``n`` (per request), ``logprobs`` and ``max_model_len``. A step advances every
running request by one token, so concurrent requests are batched exactly like the real engine's
decode loop. It is a debugging aid for the server, never a model.
"""
from __future__ import annotations

import math
import random
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

from dsflash.serve.types import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams


@dataclass
class _Req:
    rid: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: SamplingParams
    rng: random.Random
    detok: object
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: Optional[list] = None
    finish_reason: Optional[str] = None
    stop_reason: object = None


class DummyEngine:
    def __init__(self, model: str = "dummy", *, max_num_seqs: int = 16, max_model_len: int = 512,
                 step_delay_s: float = 0.002, seed: int = 0, eos_prob: float = 0.02, **opts):
        from dsflash.config import preset
        from dsflash.tokenizer import Tokenizer, write_synthetic_tokenizer

        self._tmp = tempfile.TemporaryDirectory(prefix="dsflash-dummy-tok-")
        self.tokenizer = Tokenizer.from_folder(write_synthetic_tokenizer(self._tmp.name, preset("tiny")))
        self.model_name = model
        self.max_model_len = int(max_model_len)
        self.max_num_seqs = int(max_num_seqs)
        self.step_delay_s = float(step_delay_s)
        self.eos_prob = float(eos_prob)
        self._seed = seed
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._finished_total = 0
        self._aborted_total = 0
        # ordinary text tokens to sample from: non-special ids whose bytes are printable ASCII
        added = set(self.tokenizer.hf.get_added_tokens_decoder())
        self._vocab = [i for i in range(self.tokenizer.vocab_size)
                       if i not in added and _printable(self.tokenizer.token_bytes(i))]

    # ------------------------------------------------------------------ interface
    def add_request(self, request_id: str, prompt, params: SamplingParams, arrival_time=None) -> None:
        from dsflash.tokenizer import IncrementalDetokenizer

        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be SamplingParams")
        params.validate()
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids = [int(t) for t in prompt]
            text = None
            if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
                raise ValueError(f"prompt: token ids must be in [0, {self.tokenizer.vocab_size})")
        if not ids:
            raise ValueError("prompt: must not be empty")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} prompt tokens + max_tokens {params.max_tokens} exceeds "
                             f"max_model_len {self.max_model_len}")
        if any(r.rid == request_id for r in self._waiting + self._running):
            raise ValueError(f"request_id: {request_id!r} already exists")
        seed = params.seed if params.seed is not None else random.randrange(1 << 30)
        now = time.time() if arrival_time is None else arrival_time
        self._waiting.append(_Req(
            request_id, text, ids, params, random.Random(seed),
            IncrementalDetokenizer(self.tokenizer, stop=params.stop,
                                   skip_special_tokens=params.skip_special_tokens,
                                   include_stop=params.include_stop_str_in_output),
            RequestMetrics(arrival_time=now, num_prompt_tokens=len(ids)),
            logprobs=[] if params.logprobs is not None else None))

    def prompt_logprobs(self, ids, k: int) -> list:
        """Uniform logprobs over the sampling vocabulary (the shape ``echo`` + ``logprobs`` needs)."""
        lp = -math.log(len(self._vocab))
        return [None] + [{"token_id": int(t), "logprob": lp, "top": {int(t): lp} if k else {}} for t in ids[1:]]

    def abort_request(self, request_id: str) -> None:
        for q in (self._waiting, self._running):
            for r in list(q):
                if r.rid == request_id:
                    q.remove(r)
                    self._aborted_total += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list[RequestOutput]:
        while self._waiting and len(self._running) < self.max_num_seqs:
            r = self._waiting.pop(0)
            r.metrics.first_scheduled_time = time.time()
            self._running.append(r)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        outs = []
        eos = self.tokenizer.eos_id
        for r in list(self._running):
            p = r.params
            tok = self._choose(r)
            r.token_ids.append(tok)
            now = time.time()
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = now
            r.metrics.num_generation_tokens = len(r.token_ids)
            if r.logprobs is not None:
                lp = -math.log(len(self._vocab))
                top = {t: lp for t in ([tok] + [r.rng.choice(self._vocab) for _ in range(p.logprobs)])[:max(p.logprobs, 1)]}
                r.logprobs.append({"token_id": tok, "logprob": lp, "top": top})
            if tok == eos and not p.ignore_eos:
                r.text += r.detok.finish()
                r.finish_reason, r.stop_reason = "stop", None
            elif tok in p.stop_token_ids:
                r.text += r.detok.finish()
                r.finish_reason, r.stop_reason = "stop", tok
            else:
                r.text += r.detok.add(tok)
                if r.detok.stopped:
                    r.finish_reason, r.stop_reason = "stop", r.detok.stop_reason
                elif len(r.token_ids) >= p.max_tokens or len(r.prompt_ids) + len(r.token_ids) >= self.max_model_len:
                    r.text += r.detok.finish()
                    r.finish_reason = "length"
            if r.finish_reason is not None:
                r.metrics.finished_time = now
                self._running.remove(r)
                self._finished_total += 1
            outs.append(RequestOutput(
                request_id=r.rid, prompt=r.prompt, prompt_token_ids=list(r.prompt_ids),
                outputs=[CompletionOutput(0, r.text, list(r.token_ids), r.finish_reason, r.stop_reason,
                                          list(r.logprobs) if r.logprobs is not None else None)],
                finished=r.finish_reason is not None, metrics=r.metrics))
        return outs

    def _choose(self, r: _Req) -> int:
        """The next token of ``r`` (subclasses may script it)."""
        p = r.params
        if p.temperature == 0.0:
            return self._vocab[(sum(r.prompt_ids) + 7 * len(r.token_ids)) % len(self._vocab)]
        if not p.ignore_eos and r.rng.random() < self.eos_prob:
            return self.tokenizer.eos_id
        return r.rng.choice(self._vocab)

    def metrics_snapshot(self) -> dict:
        used = sum(len(r.prompt_ids) + len(r.token_ids) for r in self._running)
        return {
            "num_requests_running": len(self._running),
            "num_requests_waiting": len(self._waiting),
            "kv_cache_usage": min(1.0, used / float(self.max_num_seqs * self.max_model_len)),
            "num_requests_finished_total": self._finished_total,
            "num_requests_aborted_total": self._aborted_total,
        }


def _printable(b: bytes) -> bool:
    return bool(b) and all(32 <= c < 127 for c in b)
