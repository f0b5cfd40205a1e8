"""Workloads for ``bench serve``: fixed input/output lengths and an AgentX-like agentic generator.

Nothing here does I/O. A workload hands a *lane* (one closed-loop client = one live session tree)
an ``async run(ctx)`` driver; the driver builds :class:`RequestSpec` s and calls ``ctx.send`` /
``ctx.think`` / ``ctx.warmup_done`` (see :class:`LaneContext`), so tests can drive a workload with
a fake context and inspect every request it would send.

Prompts are *token-ish* text: words from a fixed list of short, common English words that almost
every BPE tokenizer encodes as one token each (with the leading space), so ``n`` words is about
``n`` tokens; the server's ``usage.prompt_tokens`` is the number reported whenever it is given.
For exact lengths, the completions endpoint can send random token ids (``prompt_format="token-ids"``).

**AgentX-like sessions** (after SemiAnalysis InferenceX "AgentX", scaled down but keeping the shape):
a session is a root agent talking for many turns; every turn appends a new user message (tool
results) to a context that starts with a system prompt (tools, instructions) and the task, so the
prompt is the previous prompt plus the previous answer plus a little more — a long shared prefix
growing per turn. Answers are hundreds of tokens (lognormal around ``output_tokens``), turns are
separated by think-time gaps (exponential, capped), and some turns fan out to subagents that run
concurrently (their own multi-turn conversations that start from the same system prompt) and are
joined before the root continues, their results appended to the root's context. Every replay of a
session starts with a unique cache-busting marker, so recycled sessions and parallel lanes never
share a prefix by accident while a root and its subagents do. Warm-up starts each lane at a seeded
point in 25–75 % of its first session, sends a 1-token primer to materialise the prefix, then
``warmup_requests`` more root turns; only what follows is measured.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Optional, Protocol

import numpy as np

# Short common English words; with a leading space each is one token in common BPE vocabularies.
_WORDS = """
the of and to in is for on that with as by at from it be this are or was an not but have
all can has had its one you out more will up about so what when which who new time two may
only first over also back after use our work life just year day way man most good make well
very even any know see such here find take give long last need part much same own still high
world small place great both case end point line set right old under big each home state name
fact same kind hand off side head call move play run turn show form way next open data file code
test type list call read page word note book road room door body face mind tree city game team
rate cost plan task step node tool user view link size load mode rule text item form base unit
red blue green black white dark light cold warm hot fast slow hard soft deep flat full free true
real sure near far late early wide clear quick plain short main fine rich safe calm bold keen
run walk talk look move build write keep hold bring start stop pull push send pass fill sort
west east north south top low left down near past ever once soon often again ago yet now then
""".split()
WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORDS))  # unique, order kept


def tokenish(rng: np.random.Generator, n: int) -> str:
    """``n`` random words (about ``n`` tokens) joined by spaces."""
    if n <= 0:
        return ""
    idx = rng.integers(0, len(WORDS), size=int(n))
    return " ".join(WORDS[i] for i in idx)


def estimate_tokens(text: str, tokens_per_word: float = 1.0) -> int:
    """Client-side estimate: ``tokens_per_word`` tokens per whitespace-separated word (1.0 unless
    calibrated against the server, see ``bench serve --tokens-per-word``)."""
    return int(round(len(text.split()) * tokens_per_word))


def words_for(n_tokens: int, tokens_per_word: float = 1.0) -> int:
    """How many token-ish words make about ``n_tokens`` tokens."""
    return max(int(round(n_tokens / tokens_per_word)), 1) if n_tokens > 0 else 0


# per chat message, templates add a few tokens (role markers); an estimate only
CHAT_MESSAGE_OVERHEAD = 4


class PromptFitter:
    """Token-ish text of an exact token count under a given tokenizer (anything with
    ``encode(text) -> list[int]``, e.g. :class:`dsflash.tokenizer.Tokenizer`).

    Random words are drawn until the text is about ``n`` tokens long; then the full text is encoded
    and words are dropped from or added to the end (words that are one token each) until it is
    exactly ``n``. Only the full encoding decides, so merges across word boundaries cannot make the
    count wrong; :meth:`fit` raises ``ValueError`` when ``n`` cannot be reached (no one-token word
    in the vocabulary)."""

    def __init__(self, tokenizer, words: tuple[str, ...] = WORDS):
        self.tok = tokenizer
        self.words = tuple(words)
        self._cost: dict[str, int] = {}
        self.one_token_words = tuple(w for w in self.words if self.cost(w) == 1)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text)) if text else 0

    def cost(self, word: str) -> int:
        """Tokens of ``" " + word`` (a word inside a text)."""
        c = self._cost.get(word)
        if c is None:
            c = self._cost[word] = len(self.tok.encode(" " + word))
        return c

    def fit(self, rng: np.random.Generator, n: int, lead: str = "") -> str:
        """``lead`` (kept verbatim; may be empty) followed by random words, exactly ``n`` tokens in
        all. ``n`` must be at least the tokens of ``lead`` (+ 1 when ``lead`` is empty)."""
        n = int(n)
        words = lead.split(" ") if lead else []
        keep = len(words)
        base = self.count(lead)
        if n < base + (0 if lead else 1):
            raise ValueError(f"cannot fit {n} tokens after a lead of {base}")
        est = base
        while est < n:
            w = self.words[int(rng.integers(0, len(self.words)))]
            if est + self.cost(w) > n and self.one_token_words:
                w = self.one_token_words[int(rng.integers(0, len(self.one_token_words)))]
            words.append(w)
            est += self.cost(w)
        for _ in range(4 * n + 16):
            c = self.count(" ".join(words))
            if c == n:
                return " ".join(words)
            if c > n and len(words) > keep:
                words.pop()
            elif c < n and self.one_token_words:
                words.extend(self.one_token_words[int(rng.integers(0, len(self.one_token_words)))]
                             for _ in range(n - c))
            else:
                break
        raise ValueError(f"could not build a text of exactly {n} tokens with this tokenizer")


@dataclass
class RequestSpec:
    """One request a workload wants sent. ``messages`` for chat, ``prompt`` for completions."""
    max_tokens: int
    messages: Optional[list[dict]] = None
    prompt: Optional[object] = None          # str, or list[int] of token ids
    est_prompt_tokens: int = 0
    kind: str = "fixed"                      # fixed | primer | root | subagent
    warmup: bool = False
    lane: int = 0
    session_id: str = ""
    turn: int = 0
    parent: Optional[str] = None             # subagent: the root session id

    def as_prompt(self) -> object:
        """The completions-endpoint prompt (chat messages flattened as plain text)."""
        if self.prompt is not None:
            return self.prompt
        return "\n\n".join(f"{m['role']}: {m['content']}" for m in self.messages or [])

    def as_messages(self) -> list[dict]:
        if self.messages is not None:
            return self.messages
        if isinstance(self.prompt, str):
            return [{"role": "user", "content": self.prompt}]
        raise ValueError("a token-id prompt can only go to the completions endpoint")


class StopLane(Exception):
    """Raised by ``LaneContext.send`` / ``think`` when the lane must stop (budget or duration)."""


class LaneContext(Protocol):
    lane: int

    async def send(self, spec: RequestSpec) -> Optional[str]:
        """Send; returns the generated text, or None when the request failed. Raises StopLane."""

    async def think(self, seconds: float) -> None:
        """Idle for ``seconds`` (returns early / raises StopLane when the run stops)."""

    async def warmup_done(self) -> None:
        """Called once per lane when its warm-up is over; returns when the profiling window opens."""


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng([int(k) & 0xFFFFFFFF for k in keys])


def _nonce_int(nonce: str) -> int:
    h = 2166136261
    for ch in nonce.encode():
        h = ((h ^ ch) * 16777619) & 0xFFFFFFFF
    return h


def cache_bust_marker(nonce: str, lane: int, replay: int) -> str:
    """Unique first words of a replayed session's prefix (so no cross-replay prefix-cache hits)."""
    return f"[replay {nonce}-{lane}-{replay}]"


# ----------------------------------------------------------------------------------------------
# (a) fixed input / output lengths (vLLM's "random" dataset)
# ----------------------------------------------------------------------------------------------
@dataclass
class FixedConfig:
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0      # lengths uniform in [len*(1-r), len*(1+r)], as vLLM --random-range-ratio
    prefix_len: int = 0           # a prefix shared by every request of the run
    prompt_format: str = "text"   # text | token-ids (completions endpoint only)
    vocab_size: int = 1000        # token-ids: ids drawn uniformly from [10, vocab_size)
    warmup_requests: int = 1      # per lane

    def validate(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("range_ratio must be in [0, 1)")
        if self.prompt_format not in ("text", "token-ids"):
            raise ValueError("prompt_format must be text or token-ids")
        if self.prompt_format == "token-ids" and self.vocab_size <= 10:
            raise ValueError("vocab_size must be > 10 for token-id prompts")


class FixedWorkload:
    """Independent single-turn requests; lengths come from ``seed``, prompt text also from ``nonce``
    so that re-running with the same seed against a long-lived server gives no stale cache hits
    (apart from the deliberate ``prefix_len`` shared prefix)."""
    name = "fixed"

    def __init__(self, cfg: FixedConfig, seed: int = 0, nonce: str = "0", endpoint: str = "chat",
                 tokens_per_word: float = 1.0, fitter: Optional[PromptFitter] = None,
                 prompt_overhead: Optional[int] = None):
        """``fitter`` + ``prompt_overhead`` (the tokens the server adds around a prompt: BOS, the chat
        template) give text prompts of exactly ``input_len`` server tokens; without them the length
        is ``tokens_per_word`` x words, an estimate."""
        cfg.validate()
        if cfg.prompt_format == "token-ids" and endpoint != "completions":
            raise ValueError("token-id prompts need the completions endpoint")
        if not tokens_per_word > 0:
            raise ValueError("tokens_per_word must be > 0")
        self.cfg, self.seed, self.nonce, self.endpoint = cfg, seed, nonce, endpoint
        self.tpw = tokens_per_word
        self.fitter = fitter if cfg.prompt_format == "text" and prompt_overhead is not None else None
        self.overhead = int(prompt_overhead or 0)
        self._n = _nonce_int(nonce)
        r = _rng(seed, 7, self._n)
        if cfg.prompt_format == "token-ids":
            self.prefix_ids = [int(x) for x in r.integers(10, cfg.vocab_size, size=cfg.prefix_len)]
            self.prefix_text = ""
        elif self.fitter is not None:
            self.prefix_ids = []
            self.prefix_text = self.fitter.fit(r, cfg.prefix_len) if cfg.prefix_len > 0 else ""
        else:
            self.prefix_ids = []
            self.prefix_text = tokenish(r, words_for(cfg.prefix_len, self.tpw))

    @property
    def exact_lengths(self) -> bool:
        """True when every prompt is built to the server's exact token count."""
        return self.cfg.prompt_format == "token-ids" or self.fitter is not None

    def lengths(self, lane: int, index: int) -> tuple[int, int]:
        c = self.cfg
        r = _rng(self.seed, 1, lane, index)

        def draw(n):
            lo, hi = max(int(n * (1 - c.range_ratio)), 1), max(int(n * (1 + c.range_ratio)), 1)
            return int(r.integers(lo, hi + 1))
        return draw(c.input_len), draw(c.output_len)

    def request(self, lane: int, index: int, warmup: bool = False) -> RequestSpec:
        c = self.cfg
        n_in, n_out = self.lengths(lane, index)
        body_len = max(n_in - c.prefix_len, 1)
        r = _rng(self.seed, 2, lane, index, self._n)
        sid = f"fixed-{lane}-{index}"
        if c.prompt_format == "token-ids":
            ids = self.prefix_ids + [int(x) for x in r.integers(10, c.vocab_size, size=body_len)]
            return RequestSpec(max_tokens=n_out, prompt=ids, est_prompt_tokens=len(ids), lane=lane,
                               session_id=sid, turn=index, warmup=warmup)
        if self.fitter is not None:
            # the whole prompt, as the server counts it (template/BOS included), is exactly n_in
            text = self.fitter.fit(r, max(n_in - self.overhead, self.fitter.count(self.prefix_text) + 1),
                                   lead=self.prefix_text)
            est = self.fitter.count(text) + self.overhead
            return RequestSpec(max_tokens=n_out, prompt=text if self.endpoint != "chat" else None,
                               messages=[{"role": "user", "content": text}] if self.endpoint == "chat" else None,
                               est_prompt_tokens=est, lane=lane, session_id=sid, turn=index, warmup=warmup)
        text = (self.prefix_text + " " if self.prefix_text else "") + tokenish(r, words_for(body_len, self.tpw))
        est = estimate_tokens(text, self.tpw)
        if self.endpoint == "chat":
            return RequestSpec(max_tokens=n_out, messages=[{"role": "user", "content": text}],
                               est_prompt_tokens=est + CHAT_MESSAGE_OVERHEAD, lane=lane, session_id=sid,
                               turn=index, warmup=warmup)
        return RequestSpec(max_tokens=n_out, prompt=text, est_prompt_tokens=est, lane=lane, session_id=sid,
                           turn=index, warmup=warmup)

    async def run_lane(self, ctx: LaneContext) -> None:
        i = 0
        for _ in range(self.cfg.warmup_requests):
            await ctx.send(self.request(ctx.lane, i, warmup=True))
            i += 1
        await ctx.warmup_done()
        while True:
            await ctx.send(self.request(ctx.lane, i))
            i += 1


# ----------------------------------------------------------------------------------------------
# (b) AgentX-like multi-turn agentic sessions
# ----------------------------------------------------------------------------------------------
@dataclass
class AgentXConfig:
    """Shape of the generated sessions. Input token counts are multiplied by ``scale``; output
    lengths are not (SERVING.md §10: scale the input down, keep hundreds of output tokens).

    Real AgentX corpus (for reference): median request 142k input / 444 output tokens, >= 20
    requests per session, <= 10 concurrent subagents, ~44 % of sessions with subagents, ~99 %
    prefix-cache hits. The defaults here keep that shape at a size a small server can run."""
    system_tokens: int = 2048          # system prompt + tool definitions (shared by root and subagents)
    first_turn_tokens: int = 1024      # the task and the files first read
    turn_tokens: int = 256             # median new tokens per later turn (tool results), lognormal
    turn_sigma: float = 0.6
    output_tokens: int = 300           # median output tokens per request, lognormal ("hundreds")
    output_sigma: float = 0.4
    min_output_tokens: int = 16
    max_output_tokens: int = 2048
    min_turns: int = 20                # root turns per session, uniform in [min_turns, max_turns]
    max_turns: int = 40
    think_time: float = 1.0            # mean seconds between an answer and the next request (exponential)
    max_think_time: float = 10.0       # cap per gap
    subagent_prob: float = 0.1         # probability a root turn spawns a group of subagents
    max_fanout: int = 4                # subagents per group: uniform in [1, max_fanout] (AgentX <= 10)
    subagent_min_turns: int = 2
    subagent_max_turns: int = 6
    subagent_task_tokens: int = 512
    subagent_result_tokens: int = 128  # what each subagent's result adds to the root context
    max_context_tokens: int = 32768    # a session ends (like a compaction) before exceeding this
    scale: float = 1.0                 # multiplies the input lengths above (not outputs, not max_context)
    warmup_requests: int = 2           # root turns per lane after the primer (AgentX: 10)
    history: str = "actual"            # actual: append the server's answer text; synthetic: planned text

    def scaled(self, n: int) -> int:
        return max(int(round(n * self.scale)), 1)

    def validate(self) -> None:
        if self.min_turns < 1 or self.max_turns < self.min_turns:
            raise ValueError("need 1 <= min_turns <= max_turns")
        if self.subagent_min_turns < 1 or self.subagent_max_turns < self.subagent_min_turns:
            raise ValueError("need 1 <= subagent_min_turns <= subagent_max_turns")
        if not 0.0 <= self.subagent_prob <= 1.0:
            raise ValueError("subagent_prob must be in [0, 1]")
        if not 1 <= self.max_fanout <= 10:
            raise ValueError("max_fanout must be in [1, 10]")
        if self.think_time < 0 or self.max_think_time < 0:
            raise ValueError("think times must be >= 0")
        if self.scale <= 0:
            raise ValueError("scale must be > 0")
        if self.history not in ("actual", "synthetic"):
            raise ValueError("history must be actual or synthetic")
        if self.max_context_tokens < self.scaled(self.system_tokens + self.first_turn_tokens) + self.max_output_tokens:
            raise ValueError("max_context_tokens is too small for the system prompt and first turn")


@dataclass
class TurnPlan:
    user_tokens: int
    output_tokens: int
    think_s: float                     # idle before this turn's request
    subagents: list["SubagentPlan"] = field(default_factory=list)  # spawned after this turn's answer


@dataclass
class SubagentPlan:
    task_tokens: int
    turns: list[TurnPlan]
    result_tokens: int


@dataclass
class SessionPlan:
    lane: int
    replay: int
    turns: list[TurnPlan]

    def num_requests(self) -> int:
        return len(self.turns) + sum(len(s.turns) for t in self.turns for s in t.subagents)


class _Conversation:
    def __init__(self, system: str, tpw: float):
        self.tpw = tpw
        self.messages: list[dict] = [{"role": "system", "content": system}]
        self.est = estimate_tokens(system, tpw) + CHAT_MESSAGE_OVERHEAD

    def add(self, role: str, content: str) -> None:
        self.messages.append({"role": role, "content": content})
        self.est += estimate_tokens(content, self.tpw) + CHAT_MESSAGE_OVERHEAD

    def snapshot(self) -> list[dict]:
        return [dict(m) for m in self.messages]


class AgentXWorkload:
    name = "agentx"

    def __init__(self, cfg: AgentXConfig, seed: int = 0, nonce: str = "0", tokens_per_word: float = 1.0):
        cfg.validate()
        if not tokens_per_word > 0:
            raise ValueError("tokens_per_word must be > 0")
        self.cfg, self.seed, self.nonce, self.tpw = cfg, seed, nonce, tokens_per_word
        # the system prompt text is the same for every session (real agents share it); the
        # per-replay marker in front of it is what keeps sessions from sharing cached prefixes
        self.system_text = tokenish(_rng(seed, 11), words_for(cfg.scaled(cfg.system_tokens), tokens_per_word))

    # -- planning (pure, seeded) ---------------------------------------------------------------
    def _think(self, r: np.random.Generator) -> float:
        c = self.cfg
        return float(min(r.exponential(c.think_time), c.max_think_time)) if c.think_time > 0 else 0.0

    def _out(self, r: np.random.Generator) -> int:
        c = self.cfg
        n = c.output_tokens * math.exp(c.output_sigma * r.standard_normal())     # not scaled: "hundreds"
        return int(min(max(round(n), c.min_output_tokens), c.max_output_tokens))

    def _user(self, r: np.random.Generator, base: int) -> int:
        c = self.cfg
        return max(int(round(c.scaled(base) * math.exp(c.turn_sigma * r.standard_normal()))), 1)

    def plan(self, lane: int, replay: int) -> SessionPlan:
        """The seeded plan of replay ``replay`` on ``lane``: root turns (each with its new user
        tokens, output tokens and think time) and subagent groups, truncated so the root context
        never exceeds ``max_context_tokens``."""
        c = self.cfg
        r = _rng(self.seed, 3, lane, replay)
        n_turns = int(r.integers(c.min_turns, c.max_turns + 1))
        ctx = c.scaled(c.system_tokens) + CHAT_MESSAGE_OVERHEAD
        turns: list[TurnPlan] = []
        for t in range(n_turns):
            user = c.scaled(c.first_turn_tokens) if t == 0 else self._user(r, c.turn_tokens)
            out = self._out(r)
            think = 0.0 if t == 0 else self._think(r)
            subs: list[SubagentPlan] = []
            if t > 0 and r.random() < c.subagent_prob:
                for _ in range(int(r.integers(1, c.max_fanout + 1))):
                    k = int(r.integers(c.subagent_min_turns, c.subagent_max_turns + 1))
                    sturns = [TurnPlan(c.scaled(c.subagent_task_tokens) if j == 0 else self._user(r, c.turn_tokens),
                                       self._out(r), 0.0 if j == 0 else self._think(r)) for j in range(k)]
                    subs.append(SubagentPlan(c.scaled(c.subagent_task_tokens), sturns,
                                             c.scaled(c.subagent_result_tokens)))
            need = user + 2 * CHAT_MESSAGE_OVERHEAD + out
            if turns and ctx + need > c.max_context_tokens:
                break
            ctx += need + sum(s.result_tokens for s in subs)
            turns.append(TurnPlan(user, out, think, subs))
        return SessionPlan(lane, replay, turns)

    def warmup_start(self, plan: SessionPlan) -> int:
        """The seeded turn at which a lane joins its first session: uniform in 25–75 % of it."""
        n = len(plan.turns)
        lo, hi = int(math.floor(0.25 * n)), max(int(math.ceil(0.75 * n)) - 1, int(math.floor(0.25 * n)))
        return int(_rng(self.seed, 5, plan.lane).integers(lo, hi + 1)) if n > 1 else 0

    def _text(self, lane: int, replay: int, *key: int, n: int) -> str:
        return tokenish(_rng(self.seed, 4, lane, replay, *key), words_for(n, self.tpw))

    # -- driving -------------------------------------------------------------------------------
    async def run_lane(self, ctx: LaneContext) -> None:
        replay = 0
        plan = self.plan(ctx.lane, replay)
        start = self.warmup_start(plan)
        state = {"warm": True, "warm_left": self.cfg.warmup_requests, "primer": True}
        while True:
            await self._run_session(ctx, plan, start, state)
            replay += 1
            plan, start = self.plan(ctx.lane, replay), 0

    async def _end_warmup_if_due(self, ctx: LaneContext, state: dict) -> None:
        if state["warm"] and state["warm_left"] <= 0:
            state["warm"] = False
            await ctx.warmup_done()

    async def _run_session(self, ctx: LaneContext, plan: SessionPlan, start: int, state: dict) -> None:
        lane, replay = plan.lane, plan.replay
        sid = f"s{lane}.{replay}"
        system = cache_bust_marker(self.nonce, lane, replay) + " " + self.system_text
        conv = _Conversation(system, self.tpw)
        pending_results = ""
        # history before the warm-up start point is synthetic (it was "recorded", not generated)
        for t, turn in enumerate(plan.turns[:start]):
            conv.add("user", self._join(pending_results, self._text(lane, replay, 1, t, n=turn.user_tokens)))
            conv.add("assistant", self._text(lane, replay, 2, t, n=turn.output_tokens))
            pending_results = self._results_text(lane, replay, t, turn)
        for t in range(start, len(plan.turns)):
            turn = plan.turns[t]
            if t > start:
                await ctx.think(turn.think_s)
            conv.add("user", self._join(pending_results, self._text(lane, replay, 1, t, n=turn.user_tokens)))
            if state["primer"]:
                state["primer"] = False
                await ctx.send(RequestSpec(max_tokens=1, messages=conv.snapshot(), est_prompt_tokens=conv.est,
                                           kind="primer", warmup=True, lane=lane, session_id=sid, turn=t))
            await self._end_warmup_if_due(ctx, state)
            warm = state["warm"]
            spec = RequestSpec(max_tokens=turn.output_tokens, messages=conv.snapshot(), est_prompt_tokens=conv.est,
                               kind="root", warmup=warm, lane=lane, session_id=sid, turn=t)
            text = await ctx.send(spec)
            conv.add("assistant", self._answer(text, lane, replay, 2, t, n=turn.output_tokens))
            if warm:
                state["warm_left"] -= 1
            pending_results = ""
            if turn.subagents:
                results = await asyncio.gather(
                    *(self._run_subagent(ctx, system, sid, lane, replay, t, i, sub, warm)
                      for i, sub in enumerate(turn.subagents)), return_exceptions=True)
                stop = [e for e in results if isinstance(e, BaseException)]
                if stop:
                    raise stop[0]
                pending_results = self._results_text(lane, replay, t, turn)

    async def _run_subagent(self, ctx: LaneContext, system: str, sid: str, lane: int, replay: int, t: int,
                            i: int, sub: SubagentPlan, warm: bool) -> None:
        conv = _Conversation(system, self.tpw)
        for j, turn in enumerate(sub.turns):
            if j:
                await ctx.think(turn.think_s)
            conv.add("user", self._text(lane, replay, 3, t, i, j, n=turn.user_tokens))
            spec = RequestSpec(max_tokens=turn.output_tokens, messages=conv.snapshot(), est_prompt_tokens=conv.est,
                               kind="subagent", warmup=warm, lane=lane, session_id=f"{sid}.t{t}.a{i}", turn=j,
                               parent=sid)
            text = await ctx.send(spec)
            conv.add("assistant", self._answer(text, lane, replay, 4, t, i, j, n=turn.output_tokens))

    def _answer(self, text: Optional[str], lane: int, replay: int, *key: int, n: int) -> str:
        if self.cfg.history == "actual" and text:
            return text
        return self._text(lane, replay, *key, n=n)

    def _results_text(self, lane: int, replay: int, t: int, turn: TurnPlan) -> str:
        return "\n".join(f"[subagent {i} result] " + self._text(lane, replay, 5, t, i, n=s.result_tokens)
                         for i, s in enumerate(turn.subagents))

    @staticmethod
    def _join(a: str, b: str) -> str:
        return a + "\n" + b if a else b
