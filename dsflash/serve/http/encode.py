"""Tokenising off the event loop's GIL (the server runs these in its tokenizer thread pool)."""
from __future__ import annotations


def encode_text(tok, text: str) -> list[int]:
    """``tok.encode(text)`` through the batch call, which releases the GIL (the single call holds it: measured
    4 ticks of a 1 ms sleeper thread during a 10 s encode, 1600 during a 2 s batch encode)."""
    batch = getattr(tok, "encode_batch", None)
    return batch([text])[0] if batch is not None else tok.encode(text)


def encode_prompts(tok, texts: list[str]) -> list[list[int]]:
    """Text prompts as ``Tokenizer.encode_prompt`` gives them (BOS once), off the event loop's GIL."""
    bos = getattr(tok, "bos_id", None)
    out = []
    for t in texts:
        ids = encode_text(tok, t)
        out.append(ids if bos is None or (ids and ids[0] == bos) else [bos] + ids)
    return out


def encode_chat_prompt(chat, tok, messages, special_tokens_in_content: str = "control", **kw) -> list[int]:
    """A chat's prompt ids. ``special_tokens_in_content`` (``--special-tokens-in-content``): "control" maps
    special-token text in the request to control ids, as vLLM / SGLang / HF ``apply_chat_template`` do;
    "text" keeps it plain text, so a message cannot close its turn or forge one (docs/server.md)."""
    if special_tokens_in_content == "text" and hasattr(tok, "encode_batch_as_text"):
        return chat.encode_chat_ids_content_as_text(tok, messages, **kw)
    return encode_text(tok, chat.encode_chat(messages, **kw))
