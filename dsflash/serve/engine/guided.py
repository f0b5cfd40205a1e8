"""Guided decoding: a ``GuidedDecoding`` constraint -> an llguidance grammar -> one matcher per sequence, whose
allowed-token bitmask the runner applies to that row's logits on the device (``sampling.apply_token_mask``).

Why llguidance: an abi3 wheel without dependencies (xgrammar needs torch), and its masks are computed lazily
per token on the host (measured on the demo tokenizer: docs/server.md "Structured output").

Flow per sequence: ``Guide.fill(row)`` writes the mask of the next token into the step's input row; the
output processor calls ``Guide.accept(token)`` for each appended token. Because the mask depends on the
previous token, a guided row decodes one device iteration per call (``scheduler``). Under speculation it
verifies ``Guide.drafts`` (proposed at the end of its previous call): ``fill_block`` writes the mask of every
draft position, consuming the drafts in turn and rolling the matcher back, so a draft the grammar rejects
ends the accepted prefix on the device. With ``after_think`` the guide is dormant (all tokens allowed) until
the first ``</think>`` token.
"""
from __future__ import annotations

import json
import logging
import threading
import time

import numpy as np

from dsflash.serve.types import GuidedDecoding

log = logging.getLogger("dsflash.serve.engine.guided")

# JSON compiled compact (no free whitespace): a small model otherwise fills max_tokens with blanks
_JSON_OPTIONS = {"whitespace_flexible": False}


def _llg():
    try:
        import llguidance
    except ImportError as e:  # a runtime dependency; say which
        raise ValueError(f"guided decoding needs the 'llguidance' package ({e})") from None
    return llguidance


def grammar_of(spec: GuidedDecoding) -> str:
    """The llguidance grammar text of ``spec`` (not yet checked; see ``validate``)."""
    M = _llg().LLMatcher
    kind = spec.kind()
    if kind == "json":
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"{spec.field}: not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"{spec.field}: a JSON schema must be an object")
        return M.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return M.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "regex":
        if not isinstance(spec.regex, str) or not spec.regex:
            raise ValueError(f"{spec.field}: must be a non-empty string")
        return M.grammar_from_regex(spec.regex)
    if kind == "choice":
        ch = spec.choice
        if not isinstance(ch, list) or not ch or not all(isinstance(c, str) and c for c in ch):
            raise ValueError(f"{spec.field}: must be a non-empty list of non-empty strings")
        return M.grammar_from_lark("start: " + " | ".join(_lit(c) for c in ch))
    text = spec.grammar
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{spec.field}: must be a non-empty grammar")
    from llguidance.gbnf_to_lark import any_to_lark   # GBNF (llama.cpp / vLLM) or Lark, detected
    try:
        text = any_to_lark(text)
    except Exception as e:
        raise ValueError(f"{spec.field}: {e}") from None
    return M.grammar_from_lark(text)


def validate(spec: GuidedDecoding) -> str:
    """Compile-check ``spec``; returns its grammar. A bad schema / regex / grammar: ValueError naming the field."""
    g = grammar_of(spec)
    err = _llg().LLMatcher.validate_grammar(g)
    if err:
        raise ValueError(f"{spec.field}: {err.strip().splitlines()[0]}")
    return g


def _lit(s: str) -> str:
    """A Lark string literal (JSON escapes; non-ASCII kept as is)."""
    return json.dumps(s, ensure_ascii=False)


# ------------------------------------------------------------------ tokenizers (one per model tokenizer)
_tok_lock = threading.Lock()
_tok_cache: dict = {}


class _TokenTable:
    """What llguidance's ``TokenizerWrapper`` reads: each id's exact bytes, the added (special) ids, EOS / BOS
    and an encoder. Built from ``Tokenizer.token_bytes``: 0.4 s for the 129,280-id synthetic tokenizer, where
    handing llguidance the ``tokenizer.json`` text took 147 s (2 loaded CPU cores)."""

    def __init__(self, tokenizer, vocab_size: int):
        n = len(tokenizer)
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)] + [b""] * max(0, vocab_size - n)
        # added tokens (<think>, </think>, the chat markers ...) are never text a grammar can spell
        self.special_token_ids = sorted(i for i in tokenizer.hf.get_added_tokens_decoder() if i < vocab_size)
        self._tok = tokenizer

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text)


def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of a dsflash ``Tokenizer`` (cached per tokenizer: building it walks the vocabulary)."""
    key = (id(tokenizer), vocab_size)
    with _tok_lock:
        if key not in _tok_cache:
            llg = _llg()
            table = _TokenTable(tokenizer, vocab_size)
            _tok_cache[key] = (tokenizer, llg.LLTokenizer(llg.TokenizerWrapper(table), n_vocab=vocab_size))
        return _tok_cache[key][1]


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


# process-wide host cost of the masks (read by ``python -m dsflash.bench guided``)
STATS = {"masks": 0, "mask_s": 0.0}


class Guide:
    """One sequence's matcher. ``fill`` / ``accept`` / ``done``, see the module doc."""

    def __init__(self, spec: GuidedDecoding, tokenizer, vocab_size: int):
        llg = _llg()
        self.W = mask_words(vocab_size)
        self.eos = tokenizer.eos_id
        self.think_end = tokenizer.think_end_id if spec.after_think else None
        self.active = self.think_end is None
        self.matcher = llg.LLMatcher(ll_tokenizer(tokenizer, vocab_size), validate(spec), log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"{spec.field}: {self.matcher.get_error()}")
        self.failed = False
        self.drafts = None           # the next call's drafts (the runner's ``next_drafts``), or None

    def fill(self, row: np.ndarray) -> None:
        """The allowed-token bitmask of the next token into ``row`` (int32 [W], bit set = allowed)."""
        if not self.active:
            row[:] = -1
            return
        if self.failed or self.matcher.is_stopped():     # stopped: complete or in error; only EOS
            row[:] = 0
            row[self.eos // 32] = np.int32(np.uint32(1 << (self.eos % 32)).view(np.int32))
            return
        t0 = time.perf_counter()
        m = np.frombuffer(self.matcher.compute_bitmask(), np.int32)
        STATS["mask_s"] += time.perf_counter() - t0
        STATS["masks"] += 1
        n = min(self.W, m.shape[0])
        row[:n] = m[:n]
        row[n:] = 0

    def fill_block(self, rows: np.ndarray, drafts=()) -> list[int]:
        """Masks of a verify block into ``rows`` [len(drafts) + 1, W]: row j is the mask after the first j
        drafts. A draft the grammar rejects is replaced by the grammar's forced (fast-forward) tokens when
        there are any; otherwise it ends the accepted prefix and the rows past it repeat the last mask
        (unused). Returns the drafts to verify; the matcher is left as it was."""
        self.fill(rows[0])
        out, ff, active, n = [int(d) for d in drafts], [], self.active, 0
        try:
            for j in range(len(out)):
                if not self.active:
                    self.active = out[j] == self.think_end
                else:
                    if self.failed or not self.matcher.validate_tokens(out[j:j + 1]):
                        ff = ff or (self.matcher.compute_ff_tokens() if not self.failed else [])
                        if not ff or not self.matcher.validate_tokens(ff[:1]):   # (an error state is final)
                            rows[j + 1:] = rows[j]
                            return out
                        out[j] = ff[0]
                    ff = ff[1:] if ff and ff[0] == out[j] else []
                    self.matcher.consume_token(out[j])
                    n += 1
                self.fill(rows[j + 1])
            return out
        finally:
            if n:
                self.matcher.rollback(n)
            self.active = active

    def accept(self, token: int) -> None:
        if not self.active:
            self.active = token == self.think_end
            return
        if not self.failed and not self.matcher.consume_token(int(token)):
            # only possible if a token bypassed the mask (a bug): end the sequence rather than emit garbage
            log.warning("guided decoding: token %d rejected (%s); ending the sequence", token,
                        self.matcher.get_error())
            self.failed = True

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may follow (the sequence ends without an EOS token)."""
        return self.active and (self.failed or self.matcher.is_stopped())


# ------------------------------------------------------------------ DSML tool calls
def _dsml():
    from dsflash import chat
    return chat


def _string_value(schema: dict) -> str:
    """A ``string="true"`` value: verbatim text without ``<`` (the closing tag's start), honouring
    ``enum`` and ``minLength`` / ``maxLength``."""
    if isinstance(schema.get("enum"), list) and schema["enum"] and all(isinstance(e, str) for e in schema["enum"]):
        return "(" + " | ".join(_lit(e) for e in schema["enum"]) + ")"
    lo = int(schema.get("minLength", 0) or 0)
    hi = schema.get("maxLength")
    if hi is not None:
        rep = f"{{{lo},{int(hi)}}}"
    else:
        rep = {0: "*", 1: "+"}.get(lo, f"{{{lo},}}")
    return f"/[^<]{rep}/"


def _is_string(schema: dict) -> bool:
    return schema.get("type") == "string" or (
        "type" not in schema and isinstance(schema.get("enum"), list) and schema["enum"]
        and all(isinstance(e, str) for e in schema["enum"]))


def tool_call_grammar(tools: list[dict], parallel: bool = True) -> str:
    """A Lark grammar that admits exactly a DSML ``calls`` block invoking ``tools`` (OpenAI function tools)
    with arguments valid for each tool's ``parameters`` schema, in the form ``dsflash.chat`` renders and
    parses: string properties as ``string="true"`` verbatim text, every other property as JSON
    (``string="false"``, checked by the schema). Required properties come in schema order; optional ones
    may be left out. ``parallel=False``: exactly one invoke."""
    c = _dsml()
    D, P, I = c.DSML, c.PARAMETER_TAG, c.INVOKE_TAG
    rules, invokes = [], []
    for ti, t in enumerate(tools):
        fn = t.get("function", t)
        name = fn["name"]
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        parts = []
        for pi, (pname, ps) in enumerate(props.items()):
            ps = ps if isinstance(ps, dict) else {}
            if _is_string(ps):
                val, flag = _string_value(ps), "true"
            else:
                val, flag = "%json " + json.dumps(ps, ensure_ascii=False), "false"
            open_ = _lit(f'<{D}{P} name="{pname}" string="{flag}">')
            close = _lit(f"</{D}{P}>\n")
            rules.append(f"p{ti}_{pi}: {open_} {val} {close}")
            parts.append(f"p{ti}_{pi}" + ("" if pname in required else "?"))
        head = _lit(f'<{D}{I} name="{name}">\n')
        tail = _lit(f"</{D}{I}>\n")      # newline inside: a lone "\n" terminal would be a prefix of others
        body = " ".join(parts) if parts else '"\\n"?'    # chat.render_tool_calls leaves a blank line
        rules.append(f"inv{ti}: {head} {body} {tail}")
        invokes.append(f"inv{ti}")
    more = "+" if parallel else ""
    return "\n".join([f"start: {_lit(c.CALLS_OPEN + chr(10))} invoke{more} {_lit(c.CALLS_CLOSE)}",
                      "invoke: " + " | ".join(invokes), *rules]) + "\n"
