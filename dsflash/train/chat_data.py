"""Chat conversations built from what ships with CPython, for the supervised (SFT) stage of ``dsflash.train``.

Sources are the corpus's own (``data.py``): the ``pydoc_data`` help topics and the docstrings / signatures of the
public functions, classes and methods of ``data.MODULES``. Each source becomes an :class:`Entry` (a title, a
signature, an answer = its documentation's first paragraphs, trimmed) and each entry a few conversations:

* plain question -> answer, several phrasings (what does X do / how do I use X / signature of X / tell me about);
* a share in thinking mode, the assistant's ``reasoning_content`` a short plan from the doc's first sentence;
* a share with the two tools of :data:`TOOLS` (``lookup_doc``, ``get_signature``): the assistant emits a DSML
  call (its arguments valid for the schema), a ``tool`` message carries the result, then the answer;
* a share of two-turn conversations (a follow-up about the signature or another entry of the same module).

Everything is rendered with :func:`dsflash.chat.encode_chat`, the server's renderer, and tokenised as the server
tokenises a chat prompt. The loss mask covers exactly what the model generates when served: for each assistant
turn, the text after the prompt the server would render for it (``encode_chat(messages[:k])``, ending in
``<｜Assistant｜><think>`` or ``</think>``) up to and including the ``<｜end▁of▁sentence｜>`` that closes the turn
(reasoning, ``</think>``, content and the DSML calls block). Assistant turns that the full rendering shows in
another form than they were generated in (thinking mode without tools drops earlier turns' reasoning) are context,
not targets.

Held-out split: a conversation is held out when the corpus document its entry was built from is held out by
``data.is_heldout`` -- the documentation-perplexity split, so held-out answers come from documents the
language-model stage never trained on, and all phrasings of an entry fall on the same side.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
import warnings
from dataclasses import dataclass

import numpy as np

from dsflash.chat import encode_chat
from dsflash.train import data

#: the tools of every tool-call conversation (OpenAI function tools; one required string argument each)
TOOLS = (
    {"type": "function", "function": {
        "name": "lookup_doc", "description": "Return the documentation of a Python keyword, topic, module, "
        "class or function.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string", "description":
                       "a dotted name such as json.dumps, or a help topic such as assert"}},
                       "required": ["name"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_signature", "description": "Return the call signature of a Python function or class.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string", "description":
                       "a dotted name such as json.dumps"}},
                       "required": ["name"], "additionalProperties": False}}},
)

#: authored greetings (no CPython text): the demo model should say what it is when greeted
GREETINGS = (
    ("Hello", "Hello! I am the dsflash demo model, a small model trained on the documentation that ships with "
              "CPython. Ask me about a Python statement, module or function."),
    ("Hi!", "Hi! Ask me about Python: a statement such as with or try, or a function such as json.dumps."),
    ("Who are you?", "I am the dsflash demo model: a small DeepSeek-V4.1-style model trained on CPython's own "
                     "documentation and source code. I can answer short questions about Python."),
    ("What can you do?", "I answer short questions about Python from its documentation: what a statement does, "
                         "what a standard-library function does and how it is called."),
    ("Thanks!", "You're welcome! Ask me anything else about Python."),
)


@dataclass(frozen=True)
class Entry:
    """One thing to ask about. ``name``: what a user types (``json.dumps``, ``assert``); ``title``: how an answer
    names it; ``kind``: topic / module / class / function / method; ``answer``: the doc's first paragraphs;
    ``document``: the corpus document it comes from (decides the split)."""
    name: str
    title: str
    kind: str
    signature: str | None
    answer: str
    first_sentence: str
    document: str
    module: str | None = None


# ---------------------------------------------------------------------------------------------------- entries
_NOTE = re.compile(r"^(New in version|Added in version|Changed in version|Deprecated since)")
_UNDERLINE = re.compile(r"^\s*([=*~^-])\1{2,}\s*$")


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs; prose is unwrapped to one line, indented blocks (code, grammar) kept;
    section headings (a line over ``====``) and version notes dropped."""
    out = []
    for p in re.split(r"\n\s*\n", text.strip("\n")):       # not strip(): a leading code block keeps its indent
        lines = p.split("\n")
        while len(lines) >= 2 and _UNDERLINE.match(lines[1]):
            lines = lines[2:]
        if not lines or _NOTE.match(lines[0]):
            continue
        if all(not ln.startswith((" ", "\t", ">>>")) for ln in lines):
            p = " ".join(ln.strip() for ln in lines)
        out.append(p.rstrip())
    return [p for p in out if p.strip()]


def trim_answer(text: str, max_chars: int) -> str:
    """The first paragraphs of ``text`` up to ``max_chars``; a first paragraph longer than that is cut after its
    last full sentence that fits (or at a word, with "...")."""
    paras = _paragraphs(text)
    while len(paras) > 1 and paras[0].startswith((" ", ">>>")):     # answers start with prose, not a grammar block
        paras = paras[1:]
    if not paras:
        return ""
    out = paras[0]
    if len(out) > max_chars:
        cut = out[:max_chars]
        k = max(cut.rfind(". "), cut.rfind(".\n"))
        out = cut[:k + 1] if k > max_chars // 3 else cut[:cut.rfind(" ")].rstrip(",;:") + "..."
        return out
    kept = [out]
    for p in paras[1:]:
        if len(out) + 2 + len(p) > max_chars:
            break
        kept.append(p)
        out += "\n\n" + p
    # do not end on a sentence that leads into a block left out ("... is equivalent to")
    while len(kept) > 1 and (kept[-1].startswith((" ", ">>>")) and kept[-2].rstrip().endswith(":")
                             or not kept[-1].startswith((" ", ">>>")) and not kept[-1].rstrip().endswith(_ENDS)):
        kept.pop()
    return "\n\n".join(kept)


_ENDS = (".", "!", "?", ")", '"', "`")


def _first_sentence(text: str, max_chars: int = 200) -> str:
    p = [x for x in _paragraphs(text) if not x.startswith((" ", ">>>"))]
    s = p[0] if p else ""
    m = re.search(r"\.(\s|$)", s)
    s = s[: m.end()].strip() if m else s
    return s if len(s) <= max_chars else s[: s.rfind(" ", 0, max_chars)] + "..."


def _signature(name: str, obj) -> str | None:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None
    # defaults such as ``fallback=<object object at 0x7f...>`` name a memory address: another run, other text
    s = re.sub(r" at 0x[0-9a-fA-F]+", "", f"{name}{sig}")
    return s if len(s) <= 160 else None       # a long one would be cut mid-way: none rather than a wrong one


def _topic_entries() -> list[Entry]:
    try:
        from pydoc_data.topics import topics
    except Exception:  # pragma: no cover - a stripped stdlib
        return []
    out = []
    for k in sorted(topics):
        doc = topics[k].strip()
        lines = doc.split("\n")
        if len(lines) < 3 or not set(lines[1].strip()) <= set("*=-") or not lines[1].strip():
            continue
        title = lines[0].strip()
        body = "\n".join(lines[2:])
        ans = trim_answer(body, 1 << 30)
        if len(ans) < 40:
            continue
        title = title[0].lower() + title[1:] if title[1:2].islower() or title.startswith("The ") else title
        out.append(Entry(k, title, "topic", None, body, _first_sentence(body), doc))
    return out


def _module_entries() -> list[Entry]:
    out = []
    for mname in data.MODULES:
        try:
            mod = importlib.import_module(mname)
        except Exception:  # pragma: no cover
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            d = inspect.getdoc(mod)
            if d and len(d) > 40:
                out.append(Entry(mname, f"the {mname} module", "module", None, d, _first_sentence(d), d, mname))
            for full, obj, d, kind in data.documented(mod):     # the corpus's documents, in its order
                out.append(Entry(full, full, kind, _signature(full, obj), d, _first_sentence(d), f"{full}\n{d}",
                                 mod.__name__))
    return out


def entries(max_answer_chars: int = 400) -> list[Entry]:
    """Every entry, in a fixed order (topics by name, then ``data.MODULES`` in order); one per name. Depends on the
    Python version like the corpus does (:func:`info` records a hash)."""
    seen, out = set(), []
    for e in _topic_entries() + _module_entries():
        if e.name in seen:
            continue
        seen.add(e.name)
        ans = trim_answer(e.answer, max_answer_chars)
        if len(ans) >= 20:
            out.append(Entry(e.name, e.title, e.kind, e.signature, ans, e.first_sentence, e.document, e.module))
    return out


def run_tool(name: str, arguments: dict, index: dict[str, Entry] | None = None) -> str:
    """Execute one of :data:`TOOLS` as the training conversations did (their ``tool`` messages are these results):
    ``lookup_doc`` -> the entry's answer, ``get_signature`` -> its signature. ``index``: name -> entry (default:
    :func:`entries`)."""
    index = {e.name: e for e in entries()} if index is None else index
    e = index.get(str(arguments.get("name", "")))
    if name not in ("lookup_doc", "get_signature"):
        return f"unknown tool {name!r}"
    if e is None:
        return f"no documentation found for {arguments.get('name')!r}"
    if name == "get_signature":
        return e.signature or f"{e.name} has no signature (a {e.kind})"
    return e.answer


# ---------------------------------------------------------------------------------------------------- conversations
_Q_TOPIC = ("Tell me about {t}.", "Explain {t} in Python.", "Can you describe {t}?", "What should I know about {t}?",
            "How does {t} work?")
_Q_CALLABLE = ("What does {n} do?", "How do I use {n}?", "Explain {n}.", "What is {n} for?", "Tell me about {n}.")
_Q_SIGNATURE = ("What is the signature of {n}?", "Which arguments does {n} take?", "How is {n} called?")
_Q_MODULE = ("What is the {n} module for?", "Tell me about the {n} module.", "What does the {n} module provide?")
_Q_TOOL = ("Look up the documentation of {n}.", "What does {n} do? Check the documentation.",
           "Use the tools to find out what {n} does.", "Please look up {n} for me.")
_Q_TOOL_SIG = ("What arguments does {n} take? Use the tools.", "Get the signature of {n}.")
_FOLLOW_SIG = ("What is its signature?", "How do I call it?", "Which arguments does it take?")
_FOLLOW_OTHER = ("And {n}?", "What about {n}?", "How about {n}?")


def _answer(e: Entry, signature_first: bool) -> str:
    if e.signature and signature_first:
        return f"`{e.signature}`\n\n{e.answer}"
    return e.answer


def _plan(e: Entry, tool: str | None = None) -> str:
    """A short reasoning_content: what is asked, what the doc says, what to do."""
    what = f"about {e.title}" if e.kind in ("topic", "module") else f"about {e.name}, a {e.kind}"
    if tool:
        return f"The user asks {what}. I will call {tool} to get it."
    return f"The user asks {what}. Its documentation says: {e.first_sentence} I will answer from that."


def _call(i: int, tool: str, name: str) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": tool, "arguments": json.dumps({"name": name})}}


def _plain(e: Entry, rng: np.random.Generator, thinking: bool) -> dict:
    if e.kind == "topic":
        q, a = str(rng.choice(_Q_TOPIC)).format(t=e.title), e.answer
    elif e.kind == "module":
        q, a = str(rng.choice(_Q_MODULE)).format(n=e.name), e.answer
    elif e.signature and rng.random() < 0.3:
        q, a = str(rng.choice(_Q_SIGNATURE)).format(n=e.name), f"`{e.signature}`\n\n{e.first_sentence}"
    else:
        q, a = str(rng.choice(_Q_CALLABLE)).format(n=e.name), _answer(e, rng.random() < 0.5)
    msg = {"role": "assistant", "content": a}
    if thinking:
        msg["reasoning_content"] = _plan(e)
    return {"messages": [{"role": "user", "content": q}, msg], "tools": None, "thinking": thinking}


def _tool(e: Entry, rng: np.random.Generator, thinking: bool) -> dict:
    sig = e.signature is not None and rng.random() < 0.35
    both = e.signature is not None and not sig and rng.random() < 0.25
    if sig:
        q = str(rng.choice(_Q_TOOL_SIG)).format(n=e.name)
        calls, results = [_call(0, "get_signature", e.name)], [e.signature]
        final = f"`{e.signature}`"
    else:
        q = str(rng.choice(_Q_TOOL)).format(n=e.name)
        calls, results = [_call(0, "lookup_doc", e.name)], [e.answer]
        final = e.answer
        if both:
            calls.append(_call(1, "get_signature", e.name))
            results.append(e.signature)
            final = f"`{e.signature}`\n\n{e.answer}"
    first = {"role": "assistant", "content": "", "tool_calls": calls}
    last = {"role": "assistant", "content": final}
    if thinking:
        first["reasoning_content"] = _plan(e, " and ".join(c["function"]["name"] for c in calls))
        last["reasoning_content"] = f"The tool returned the {'signature' if sig else 'documentation'} of {e.name}. " \
                                    "I will answer from it."
    msgs = [{"role": "user", "content": q}, first]
    msgs += [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(calls, results)]
    return {"messages": msgs + [last], "tools": [dict(t) for t in TOOLS], "thinking": thinking}


def _multi(e: Entry, other: Entry | None, rng: np.random.Generator, thinking: bool) -> dict:
    conv = _plain(e, rng, thinking)
    if e.signature and (other is None or rng.random() < 0.5):
        q2, a2, plan = str(rng.choice(_FOLLOW_SIG)), f"`{e.signature}`", f"The user asks for the signature of {e.name}."
    elif other is not None:
        q2, a2, plan = str(rng.choice(_FOLLOW_OTHER)).format(n=other.name), other.answer, _plan(other)
    else:
        return conv
    msg = {"role": "assistant", "content": a2}
    if thinking:
        msg["reasoning_content"] = plan
    conv["messages"] += [{"role": "user", "content": q2}, msg]
    return conv


def conversations(seed: int = 0, per_entry: int = 3, thinking_share: float = 0.25, tool_share: float = 0.2,
                  multi_share: float = 0.1, max_answer_chars: int = 400, limit: int | None = None,
                  copy_share: float = 0.0) -> list[dict]:
    """Deterministic conversations: ``per_entry`` per entry (each a seeded choice of plain / tool / two-turn and of
    thinking), then the greetings, then ``round(copy_share x training entries)`` copy conversations
    (:func:`copy_conversations`; their own RNG, so the others do not depend on it). Each is ``{"messages",
    "tools", "thinking", "name", "heldout"}`` (copy ones also ``"copy": True``); ``limit`` keeps the first that
    many entries (tests)."""
    for k, v in (("thinking_share", thinking_share), ("tool_share", tool_share), ("multi_share", multi_share)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{k} must be in [0, 1], got {v!r}")
    if copy_share < 0:
        raise ValueError(f"copy_share must be >= 0, got {copy_share!r}")
    if tool_share + multi_share > 1.0:
        raise ValueError(f"tool_share + multi_share must be <= 1, got {tool_share} + {multi_share}")
    es = entries(max_answer_chars)[:limit]
    rng = np.random.default_rng(seed)
    by_module: dict[str, list[Entry]] = {}
    for e in es:
        if e.module:
            by_module.setdefault(e.module, []).append(e)
    out = []
    for e in es:
        held = data.is_heldout(e.document)
        for _ in range(per_entry):
            u, thinking = rng.random(), bool(rng.random() < thinking_share)
            if u < tool_share:
                c = _tool(e, rng, thinking)
            elif u < tool_share + multi_share:
                # the follow-up entry is from the same split, so no held-out answer trains
                pool = [o for o in by_module.get(e.module, []) if o is not e and data.is_heldout(o.document) == held]
                c = _multi(e, pool[int(rng.integers(len(pool)))] if pool else None, rng, thinking)
            else:
                c = _plain(e, rng, thinking)
            out.append(dict(c, name=e.name, heldout=held))
    for i, (q, a) in enumerate(GREETINGS):     # always training rows: authored text, nothing to hold out
        for thinking in (False, True):
            msg = {"role": "assistant", "content": a}
            if thinking:
                msg["reasoning_content"] = "The user greets me or asks what I am. I will introduce myself briefly."
            out.append({"messages": [{"role": "user", "content": q}, msg], "tools": None, "thinking": thinking,
                        "name": f"greeting:{i}", "heldout": False})
    train_es = [e for e in es if not data.is_heldout(e.document)]
    return out + copy_conversations(train_es, round(copy_share * len(train_es)), seed)


# ---------------------------------------------------------------------------------------------------- copy tasks
_COPY_SAY = ("Remember this name: {n}.", "Keep the name {n} in mind.", "The name is {n}.", "Note the name {n}.")
_COPY_ASK = ("Which name did I ask you to remember?", "Repeat the name from the start of my message.",
             "What was the name I gave you?", "Say the name again.")


def copy_conversations(es: list[Entry], n: int, seed: int = 0, min_filler: int = 160,
                       max_filler: int = 400) -> list[dict]:
    """``n`` synthetic "copy beyond the window" conversations: the user gives an entry's name once, then a
    documentation passage (another entry's answer, cut at a word to ``min_filler``-``max_filler`` characters:
    ~40-100 demo tokens), then asks for the name back; the assistant's whole answer is the name, so its first
    token must be copied from further back than the demo's 32-token window (a passage shorter than drawn gets the
    next entry's answer appended before the cut). Entries drawn with replacement from
    ``es`` (pass training entries only: these are training rows, ``heldout`` False), seeded by ``seed``."""
    if n and len(es) < 2:
        raise ValueError("copy_conversations needs at least two entries (a name and a passage)")
    rng = np.random.default_rng([seed, 0xC0B1])
    out = []
    for _ in range(n):
        i = int(rng.integers(len(es)))
        e, k, filler = es[i], int(rng.integers(min_filler, max_filler + 1)), ""
        while len(filler) < k:                               # other entries' answers, until long enough
            j = int(rng.integers(len(es) - 1))
            filler = (filler + " " + " ".join(es[j + (j >= i)].answer.split())).strip()
        cut = filler.rfind(" ", 0, k + 1)
        filler = filler[:cut if cut >= min_filler else k]
        q = f"{str(rng.choice(_COPY_SAY)).format(n=e.name)}\n\n{filler}\n\n{str(rng.choice(_COPY_ASK))}"
        out.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": e.name}],
                    "tools": None, "thinking": False, "name": e.name, "heldout": False, "copy": True})
    return out


def split(convs: list[dict]) -> tuple[list[dict], list[dict]]:
    return [c for c in convs if not c["heldout"]], [c for c in convs if c["heldout"]]


def trial_conversations(convs: list[dict], n: int, split_name: str = "heldout") -> dict:
    """{"tool": [...], "answer": [...]}: the conversations the chat trials score (``scripts/chat_samples.py
    --trials``, ``scripts/index_picks_share.py``): the first ``n`` held-out ones with tools and ``n`` without, or
    with ``split_name="train"`` ``n`` of each spread evenly over the named training conversations."""
    train, held = split(convs)                  # (greetings are always training rows)
    if split_name == "heldout":
        return {"tool": [c for c in held if c["tools"]][:n], "answer": [c for c in held if not c["tools"]][:n]}
    if split_name == "train":
        named = [c for c in train if c.get("name")]
        return {k: g[:: max(1, len(g) // n)][:n] for k, g in
                (("tool", [c for c in named if c["tools"]]), ("answer", [c for c in named if not c["tools"]]))}
    raise ValueError(f"split must be 'heldout' or 'train', not {split_name!r}")


def info(convs: list[dict]) -> dict:
    h = hashlib.sha256(json.dumps([(c["messages"], c["thinking"], bool(c["tools"])) for c in convs],
                                  sort_keys=True).encode("utf-8")).hexdigest()
    tr, he = split(convs)
    return {"conversations": len(convs), "train": len(tr), "heldout": len(he),
            "thinking": sum(c["thinking"] for c in convs), "tool_calls": sum(bool(c["tools"]) for c in convs),
            "multi_turn": sum(sum(m["role"] == "user" for m in c["messages"]) > 1 for c in convs), "sha256": h}


# ---------------------------------------------------------------------------------------------------- rendering
def render(conv: dict) -> list[tuple[str, bool]]:
    """The conversation as the server renders it, cut into ``(text, is_target)`` segments that join to
    ``encode_chat(messages, add_generation_prompt=False)``. A target is one assistant turn's generation: from the
    end of the prompt the server renders for that turn to the end of the turn (its EOS included)."""
    kw = {"tools": conv.get("tools"), "thinking": conv["thinking"]}
    msgs = conv["messages"]
    full = encode_chat(msgs, add_generation_prompt=False, **kw)
    segs, pos = [], 0
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = encode_chat(msgs[:k], add_generation_prompt=True, **kw)
        turn = encode_chat(msgs[:k + 1], add_generation_prompt=False, **kw)
        if not (full.startswith(turn) and turn.startswith(prompt) and len(prompt) >= pos):
            continue            # rendered otherwise than generated (dropped reasoning): context only
        segs += [(full[pos:len(prompt)], False), (turn[len(prompt):], True)]
        pos = len(turn)
    segs.append((full[pos:], False))
    return [(t, y) for t, y in segs if t]


def encode(tokenizer, conv: dict) -> tuple[np.ndarray, np.ndarray]:
    """-> (ids int32, mask bool: the target tokens). Segments are tokenised one by one; each cut sits next to a
    control token (``<think>`` / ``</think>`` / EOS), so the ids equal the server's tokenisation of the whole text
    (checked)."""
    segs = render(conv)
    parts = tokenizer.encode_batch([t for t, _ in segs])
    ids = [i for p in parts for i in p]
    whole = tokenizer.encode_batch(["".join(t for t, _ in segs)])[0]
    if ids != whole:
        raise ValueError(f"chat_data.encode: segment tokenisation differs from the whole text's ({conv['name']})")
    mask = [y for p, (_, y) in zip(parts, segs) for _ in p]
    return np.asarray(ids, np.int32), np.asarray(mask, bool)


def source_positions(tokenizer, conv: dict, ids) -> list[int]:
    """Token positions (in ``ids``, the conversation's :func:`encode`) of the first mention of ``conv["name"]`` in
    its first user message: what a tool call's argument or a copy conversation's answer must copy. [] when the
    name is not there (greetings, topics asked about by title)."""
    user = next(m["content"] for m in conv["messages"] if m["role"] == "user").encode("utf-8")
    name = str(conv.get("name", "")).encode("utf-8")
    text = "".join(t for t, _ in render(conv)).encode("utf-8")
    u = text.find(user)
    m = re.compile(rb"(?<![\w.])" + re.escape(name) + rb"(?!\w)").search(text, u, u + len(user)) \
        if u >= 0 and name else None      # the whole name ("in" is not the one in "find")
    if m is None:
        return []
    e = m.start()
    out, pos = [], 0
    for t, i in enumerate(ids):
        n = len(tokenizer.token_bytes(int(i)))
        if pos < e + len(name) and pos + n > e:
            out.append(t)
        pos += n
    return out


def pack_layout(lengths: list[int], seq_len: int) -> tuple[list[list[tuple[int, int]]], int]:
    """Greedy in-order packing of conversations of ``lengths`` into rows of ``seq_len`` (one never spans two rows;
    longer ones dropped). -> ([per row: (conversation index, offset in the row)], how many were dropped)."""
    rows, cur, used, dropped = [], [], 0, 0
    for i, n in enumerate(lengths):
        if n > seq_len:
            dropped += 1
            continue
        if used + n > seq_len:
            rows.append(cur)
            cur, used = [], 0
        cur.append((i, used))
        used += n
    if cur:
        rows.append(cur)
    return rows, dropped


def pack_conversations(examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int
                       ) -> tuple[np.ndarray, np.ndarray, int]:
    """Whole conversations packed in order into ``[N, seq_len]`` rows (a conversation never spans two rows; the
    rest of a row is ``pad_id``, unmasked) -- as documents were packed for pre-training, BOS separating them.
    -> (ids, mask, how many were longer than ``seq_len`` and dropped)."""
    layout, dropped = pack_layout([len(ids) for ids, _ in examples], seq_len)
    rows = np.full((len(layout), seq_len), pad_id, np.int32)
    masks = np.zeros((len(layout), seq_len), bool)
    for r, row in enumerate(layout):
        for i, off in row:
            ids, mask = examples[i]
            rows[r, off:off + len(ids)], masks[r, off:off + len(ids)] = ids, mask
    return rows, masks, dropped


def row_sources(layout, lengths: list[int], sources: list[list[int]]) -> list[list[tuple[list[int], int]]]:
    """Per packed row (``pack_layout``'s ``layout``): ``(the source tokens' row positions, the row position where
    that conversation ends)`` of each conversation with source tokens (:func:`source_positions`)."""
    return [[([off + p for p in sources[i]], off + lengths[i]) for i, off in row if sources[i]] for row in layout]


def teacher_entries(rows_src, seq_len: int, ratio: int, n_max: int = 8) -> np.ndarray:
    """``[len(rows_src), seq_len, n_max]`` int32: at each position after a conversation's source tokens and before
    its end, the compressed entries (at ``ratio``) covering those tokens (their first ``n_max``), -1 elsewhere --
    the entries the SFT stage's teacher picks force into the indexer's top-k there (``teacher_picks``)."""
    out = np.full((len(rows_src), seq_len, n_max), -1, np.int32)
    for r, srcs in enumerate(rows_src):
        for pos, end in srcs:
            ent = sorted({p // ratio for p in pos})[:n_max]
            out[r, max(pos) + 1:end, :len(ent)] = ent
    return out


def first_turn_prompts(tokenizer, convs: list[dict]) -> list[list[int]]:
    """The prompt of each conversation's first assistant turn (tools and thinking as the conversation has them),
    rendered and tokenised as the server renders and tokenises that chat request."""
    out = []
    for c in convs:
        k = next(i for i, m in enumerate(c["messages"]) if m["role"] == "assistant")
        out.append(tokenizer.encode(encode_chat(c["messages"][:k], tools=c["tools"], thinking=c["thinking"])))
    return out


def chat_rows(tokenizer, convs: list[dict], seq_len: int, seed: int = 0, sources: bool = False) -> tuple:
    """Encode and pack ``convs`` after a seeded shuffle (so rows mix kinds of conversation). -> (ids, mask,
    dropped); ``sources``: and per row :func:`row_sources` of the tool-call and copy conversations (what teacher
    picks force)."""
    order = np.random.default_rng(seed).permutation(len(convs))
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    examples = [encode(tokenizer, convs[i]) for i in order]
    ids, mask, dropped = pack_conversations(examples, seq_len, pad)
    if not sources:
        return ids, mask, dropped
    src = [source_positions(tokenizer, convs[i], x) if convs[i].get("tools") or convs[i].get("copy") else []
           for i, (x, _) in zip(order, examples)]
    lengths = [len(x) for x, _ in examples]
    return ids, mask, dropped, row_sources(pack_layout(lengths, seq_len)[0], lengths, src)
