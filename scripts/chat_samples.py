"""Real chat exchanges with a checkpoint (greedy, through dsflash.LLM.chat, the server's template and parser):
a plain question, one in thinking mode, and a tool-call round trip -- the model's DSML call is parsed with
dsflash.chat.parse_output, checked against the tool's schema, executed (chat_data.run_tool, the tools the SFT
conversations used) and its result sent back for the final answer. ``--trials N``: also the first turn of the first
N held-out conversations with tools and N without (``--trials-split train``: N of each from the training ones), with
no grammar (what the model does unaided), scored as ``trials`` -- tool turns: a parseable call, every call
schema-valid, the asked-about name in the arguments; other turns: ended by the model (not the token limit) with
content and no leaked markup, the name in the answer.
Prints JSON.

    python scripts/chat_samples.py CHECKPOINT_DIR [--max-tokens 160] [--trials 20]
"""
import argparse
import json

import jsonschema

import dsflash
from dsflash.chat import parse_output
from dsflash.serve.types import SamplingParams
from dsflash.train import chat_data


SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in chat_data.TOOLS}


def schema_error(call) -> str | None:
    """Why a parsed tool call does not fit its tool's schema (unknown tool, arguments not JSON or invalid); None
    when it fits."""
    try:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    except (ValueError, jsonschema.ValidationError, KeyError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def turn(llm, messages, sp, **kw):
    text = llm.chat(messages, sp, **kw)[0].outputs[0].text
    reasoning, content, calls = parse_output(text, thinking=kw.get("thinking", False))
    return {"raw": text, "reasoning_content": reasoning, "content": content, "tool_calls": calls}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--question", default="What does textwrap.dedent do?")
    ap.add_argument("--tool-question", default="Look up the documentation of json.loads.")
    ap.add_argument("--trials", type=int, default=0, help="also score the first turn of N held-out conversations "
                    "with tools and N without")
    ap.add_argument("--trials-split", choices=("heldout", "train"), default="heldout",
                    help="train: score N of each spread over the training conversations instead (recall)")
    a = ap.parse_args(argv)
    llm = dsflash.LLM(a.checkpoint, max_num_seqs=2, max_model_len=2048)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    out = {"checkpoint": a.checkpoint}
    msgs = [{"role": "user", "content": a.question}]
    out["plain"] = {"messages": msgs, **turn(llm, msgs, sp)}
    out["thinking"] = {"messages": msgs, **turn(llm, msgs, sp, thinking=True)}
    tools = [dict(t) for t in chat_data.TOOLS]
    msgs = [{"role": "user", "content": a.tool_question}]
    first = turn(llm, msgs, sp, tools=tools)
    rec = {"messages": list(msgs), "first": first}
    if first["tool_calls"]:
        index = {e.name: e for e in chat_data.entries()}
        msgs.append({"role": "assistant", "content": first["content"] or "", "tool_calls": first["tool_calls"]})
        for c in first["tool_calls"]:
            err = schema_error(c)
            c["schema_valid"] = True if err is None else f"invalid: {err}"
            msgs.append({"role": "tool", "tool_call_id": c["id"], "content": chat_data.run_tool(
                c["function"]["name"], json.loads(c["function"]["arguments"]), index)})
        rec["tool_messages"] = msgs[2:]
        rec["final"] = turn(llm, msgs, sp, tools=tools)
    out["tool_call"] = rec
    if a.trials:
        out["trials"] = trials(llm, sp, a.trials, a.trials_split)
        out["trials_split"] = a.trials_split
    print(json.dumps(out, indent=2, ensure_ascii=False))


def trials(llm, sp, n, split="heldout"):
    """First turns of ``n`` held-out tool conversations and ``n`` others, batched, scored (module docstring).
    ``split="train"``: ``n`` of each spread evenly over the training conversations instead (entries the model
    was fine-tuned on: recall, where held-out entries need the name copied from the question)."""
    picks = chat_data.trial_conversations(chat_data.conversations(), n, split)
    res = {}
    for kind, convs in picks.items():
        rows, outs = [], {}
        for thinking in (False, True):         # batched: one chat call per set of chat options
            group = [c for c in convs if c["thinking"] == thinking]
            if group:
                got = llm.chat([c["messages"][:1] for c in group], sp, thinking=thinking, tools=group[0]["tools"])
                outs.update({id(c): r.outputs[0] for c, r in zip(group, got)})
        for conv in convs:
            o = outs[id(conv)]
            reasoning, content, calls = parse_output(o.text, thinking=conv["thinking"])
            row = {"name": conv["name"], "thinking": conv["thinking"], "finish_reason": o.finish_reason,
                   "raw": o.text}
            if kind == "tool":
                row.update(calls=len(calls), all_valid=bool(calls) and all(schema_error(c) is None for c in calls),
                           names_entry=any(conv["name"] in c["function"]["arguments"] for c in calls))
            else:
                leaked = any(m in (content or "") for m in ("DSML", "<think>", "</think>", "<\uff5c"))
                row.update(ended=o.finish_reason == "stop", has_content=bool((content or "").strip()),
                           leaked_markup=leaked, names_entry=conv["name"].split(".")[-1] in (content or ""))
            rows.append(row)
        keys = ("calls", "all_valid", "names_entry") if kind == "tool" else \
            ("ended", "has_content", "leaked_markup", "names_entry")
        res[kind] = {"n": len(rows), **{k: sum(bool(r[k]) for r in rows) for k in keys}, "rows": rows}
    return res


if __name__ == "__main__":
    main()
