"""Real chat exchanges with a checkpoint (greedy, through dsflash.LLM.chat, the server's template and parser):
a plain question, one in thinking mode, and a tool-call round trip -- the model's DSML call is parsed with
dsflash.chat.parse_output, checked against the tool's schema, executed (chat_data.run_tool, the tools the SFT
conversations used) and its result sent back for the final answer. Prints JSON.

    python scripts/chat_samples.py CHECKPOINT_DIR [--max-tokens 160]
"""
import argparse
import json

import jsonschema

import dsflash
from dsflash.chat import parse_output
from dsflash.serve.types import SamplingParams
from dsflash.train import chat_data


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
    a = ap.parse_args(argv)
    llm = dsflash.LLM(a.checkpoint, max_num_seqs=2, max_model_len=2048)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    out = {"checkpoint": a.checkpoint}
    msgs = [{"role": "user", "content": a.question}]
    out["plain"] = {"messages": msgs, **turn(llm, msgs, sp)}
    out["thinking"] = {"messages": msgs, **turn(llm, msgs, sp, thinking=True)}
    tools = [dict(t) for t in chat_data.TOOLS]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    msgs = [{"role": "user", "content": a.tool_question}]
    first = turn(llm, msgs, sp, tools=tools)
    rec = {"messages": list(msgs), "first": first}
    if first["tool_calls"]:
        index = {e.name: e for e in chat_data.entries()}
        msgs.append({"role": "assistant", "content": first["content"] or "", "tool_calls": first["tool_calls"]})
        for c in first["tool_calls"]:
            args = json.loads(c["function"]["arguments"])
            try:
                jsonschema.validate(args, schemas[c["function"]["name"]])
                valid = True
            except (jsonschema.ValidationError, KeyError) as e:
                valid = f"invalid: {e}"
            c["schema_valid"] = valid
            msgs.append({"role": "tool", "tool_call_id": c["id"],
                         "content": chat_data.run_tool(c["function"]["name"], args, index)})
        rec["tool_messages"] = msgs[2:]
        rec["final"] = turn(llm, msgs, sp, tools=tools)
    out["tool_call"] = rec
    print(json.dumps(out, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
