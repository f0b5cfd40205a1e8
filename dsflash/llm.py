"""Offline inference API in the spirit of vLLM's ``LLM``: ``generate``, ``chat``, streaming, datasets.

    llm = dsflash.LLM("tiny", max_num_seqs=8)
    outs = llm.generate(["Hello", [0, 5, 7]], dsflash.SamplingParams(max_tokens=16, temperature=0))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].outputs[0].finish_reason

Every call runs the continuous-batching engine (``dsflash.serve.engine.LLMEngine``) until its requests
finish; engine options (``max_num_seqs``, ``max_model_len``, ``speculative``, ``num_pages``, ...) are
keyword arguments of ``LLM``.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence

from dsflash.serve.engine import LLMEngine
from dsflash.serve.types import RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def _is_single_prompt(prompts) -> bool:
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return True
    return False


class LLM:
    def __init__(self, model="demo", *, coordinator: str | None = None, num_processes: int | None = None,
                 process_id: int | None = None, **engine_options):
        """``coordinator`` / ``num_processes`` / ``process_id``: join a ``jax.distributed`` job first (None: what
        JAX finds itself, e.g. ``JAX_COORDINATOR_ADDRESS``; or call ``dsflash.sharding.mesh.init_distributed``
        before). In a multi-controller job every process builds the same ``LLM`` (``mesh`` over all processes'
        devices); process 0 generates, the others call ``follow()``; process 0's ``close()`` (or the end of a
        ``with`` block) releases them (docs/multihost.md)."""
        if coordinator is not None or num_processes is not None or process_id is not None:
            from dsflash.sharding.mesh import init_distributed
            init_distributed(coordinator, num_processes, process_id)
        self.engine = LLMEngine(model, **engine_options)
        self._ids = itertools.count()

    # ------------------------------------------------------------------ multi-controller jobs
    @property
    def is_leader(self) -> bool:
        """True in one process, and in process 0 of a multi-controller job."""
        return self.engine.is_leader

    def follow(self) -> int:
        """A follower's part: run process 0's steps until it closes; returns the number of steps."""
        return self.engine.follow()

    def close(self) -> None:
        """Release a multi-controller job's followers (process 0; a no-op elsewhere and when done already)."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an existing engine (shares its compiled programs and caches)."""
        self = cls.__new__(cls)
        self.engine = engine
        self._ids = itertools.count()
        return self

    # ------------------------------------------------------------------ properties
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def metrics(self):
        return self.engine.metrics

    def metrics_snapshot(self) -> dict:
        return self.engine.metrics_snapshot()

    # ------------------------------------------------------------------ helpers
    def _normalise(self, prompts, sampling_params):
        if _is_single_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sps = [sampling_params] * len(prompts)
        else:
            sps = list(sampling_params)
            if len(sps) != len(prompts):
                raise ValueError(f"sampling_params: got {len(sps)} for {len(prompts)} prompts")
        return prompts, sps

    def _add(self, prompt, sp) -> str:
        rid = f"llm-{next(self._ids)}"
        self.engine.add_request(rid, prompt, sp)
        return rid

    def _drain(self, rids: set[str]) -> Iterator[RequestOutput]:
        pending = set(rids)
        while pending:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("engine went idle with requests outstanding")
            for out in self.engine.step():
                if out.request_id in pending:
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out

    # ------------------------------------------------------------------ API
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for one prompt or a batch (strings or token-id lists); results in input order."""
        prompts, sps = self._normalise(prompts, sampling_params)
        rids = []
        try:
            for p, sp in zip(prompts, sps):
                rids.append(self._add(p, sp))
        except Exception:
            for r in rids:
                self.engine.abort_request(r)
            raise
        done = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(rids), desc="generate")
        for out in self._drain(set(rids)):
            if out.finished:
                done[out.request_id] = out
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [done[r] for r in rids]

    def generate_stream(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Yield cumulative ``RequestOutput``s as tokens arrive (any order across prompts)."""
        prompts, sps = self._normalise(prompts, sampling_params)
        rids = [self._add(p, sp) for p, sp in zip(prompts, sps)]
        it = self._drain(set(rids))
        try:
            yield from it
        finally:  # a consumer that stops early must not leave requests behind
            for r in rids:
                if r in self.engine.groups:
                    self.engine.abort_request(r)
            self.engine.discard_pending_outputs()

    def chat(self, messages, sampling_params=None, *, use_tqdm: bool = False, **chat_options) -> list[RequestOutput]:
        """Chat completion with the V4.1 chat encoding (``dsflash.chat.encode_chat``).

        ``messages``: one conversation (a list of ``{"role", "content"}`` dicts) or a list of them.
        ``chat_options`` go to ``encode_chat`` (``thinking``, ``tools``, ``reasoning_effort``, ...)."""
        from dsflash.chat import encode_chat_ids
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer, chat needs one")
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [encode_chat_ids(self.tokenizer, c, **chat_options) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate_dataset(self, source, sampling_params=None, *, prompt_key: str | None = "prompt",
                         max_in_flight: int | None = None) -> Iterator[tuple[int, RequestOutput]]:
        """Offline batched inference over a dataset, read through ``grain``.

        ``source``: a grain ``MapDataset``/``IterDataset``, or any random-access source (list, grain
        data source) of prompts or of records holding one under ``prompt_key``. Keeps up to
        ``max_in_flight`` requests (default ``2 x max_num_seqs``) in the engine so it stays full; yields
        ``(index, RequestOutput)`` in dataset order."""
        import grain
        if isinstance(source, (grain.MapDataset, grain.IterDataset)):
            ds = source
        else:
            ds = grain.MapDataset.source(source)

        def to_prompt(rec):
            if prompt_key is not None and isinstance(rec, Mapping):
                return rec[prompt_key]
            return rec

        ds = ds.map(to_prompt)
        it = iter(ds.to_iter_dataset() if isinstance(ds, grain.MapDataset) else ds)
        sp = sampling_params if sampling_params is not None else SamplingParams()
        limit = max_in_flight or 2 * self.engine.max_num_seqs
        index_of: dict[str, int] = {}
        ready: dict[int, RequestOutput] = {}
        next_out = n_added = 0
        exhausted = False
        try:
            while True:
                while not exhausted and len(index_of) < limit:
                    try:
                        prompt = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    index_of[self._add(prompt, sp)] = n_added
                    n_added += 1
                if not index_of:
                    break
                for out in self.engine.step():
                    if out.finished and out.request_id in index_of:
                        ready[index_of.pop(out.request_id)] = out
                while next_out in ready:
                    yield next_out, ready.pop(next_out)
                    next_out += 1
            while next_out in ready:
                yield next_out, ready.pop(next_out)
                next_out += 1
        finally:
            for r in list(index_of):
                self.engine.abort_request(r)
            self.engine.discard_pending_outputs()
