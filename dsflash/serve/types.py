"""Request-level types shared by the engine, the offline API and the HTTP server (vLLM-like names)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class GuidedDecoding:
    """A constraint on the generated text, enforced by a grammar (``dsflash/serve/engine/guided.py``).

    Exactly one of ``json`` (a JSON schema, dict or JSON text), ``json_object`` (any JSON object), ``regex``,
    ``choice`` (one of the strings) or ``grammar`` (Lark in llguidance's dialect, or GBNF) is set.
    ``after_think``: the constraint starts after the first ``</think>`` token (thinking mode).
    ``field``: the request field it came from, named in error messages."""
    json: Optional[Union[dict, str]] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    after_think: bool = False
    field: str = "guided"

    def kind(self) -> str:
        set_ = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise ValueError(f"{self.field}: exactly one constraint must be given, got {set_ or 'none'}")
        return set_[0]


@dataclass
class SamplingParams:
    """Per-request sampling. Invalid values raise ValueError naming the field (see ``validate``)."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0 or -1 = off
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: Optional[int] = None  # number of top logprobs per generated token (0 = only the chosen)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    guided: Optional[GuidedDecoding] = None   # structured output (None: unconstrained)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def bad(name, msg):
            raise ValueError(f"SamplingParams.{name}: {msg}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", f"must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= 128:
            bad("n", f"must be an integer in [1, 128], got {self.n!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.guided is not None:
            if not isinstance(self.guided, GuidedDecoding):
                bad("guided", "must be a GuidedDecoding")
            self.guided.kind()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **kw) -> "SamplingParams":
        return dataclasses.replace(self, **kw)


@dataclass
class EngineRequest:
    """The one request envelope from the HTTP layer (or ``LLM``) to the engine: what to run and where.

    ``dp_rank`` pins the request to a DP rank (the ``X-data-parallel-rank`` header; None: the load balancer
    picks). ``kv_transfer_params`` are the P/D fields of the request body (``docs/pd.md``; None: no P/D)."""
    request_id: str
    prompt: Union[str, list[int]]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: Optional[float] = None
    dp_rank: Optional[int] = None
    kv_transfer_params: Optional[dict] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None       # "stop" | "length" | "abort" | None while running
    stop_reason: Optional[object] = None      # the stop string / token id that ended it
    logprobs: Optional[list[dict]] = None     # per token: {"token_id", "logprob", "top": {id: logprob}}


@dataclass
class RequestMetrics:
    arrival_time: float = 0.0
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
