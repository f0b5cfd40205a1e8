"""Pydantic models of the OpenAI-compatible request bodies (and the vLLM extras we accept).

Types are checked here (a wrong type is a 400 naming the field); value ranges are checked by
``SamplingParams.validate`` (also a 400 naming the field). Sampling fields default to None = "not sent":
``SamplingParams`` is the one home of their defaults. Unknown fields are accepted and ignored
(as vLLM does), so clients that send newer OpenAI parameters keep working; they are listed in the
server log.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class StreamOptions(_Base):
    include_usage: Optional[StrictBool] = False
    continuous_usage_stats: Optional[StrictBool] = False


class JsonSchemaSpec(_Base):
    name: Optional[StrictStr] = None
    description: Optional[StrictStr] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaSpec] = None


class _SamplingFields(_Base):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: Optional[StrictStr] = None
    temperature: Optional[StrictFloat] = None
    top_p: Optional[StrictFloat] = None
    n: Optional[StrictInt] = 1
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    seed: Optional[StrictInt] = None
    presence_penalty: Optional[StrictFloat] = None
    frequency_penalty: Optional[StrictFloat] = None
    logit_bias: Optional[dict[str, StrictFloat]] = None
    user: Optional[StrictStr] = None
    # vLLM extras
    top_k: Optional[StrictInt] = None
    min_p: Optional[StrictFloat] = None
    repetition_penalty: Optional[StrictFloat] = None
    ignore_eos: Optional[StrictBool] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    include_stop_str_in_output: Optional[StrictBool] = None
    skip_special_tokens: Optional[StrictBool] = None
    min_tokens: Optional[StrictInt] = 0
    request_id: Optional[StrictStr] = None
    # structured output (dsflash/serve/http/structured.py): OpenAI's response_format (chat: also rendered into
    # the prompt), vLLM's structured_outputs and guided_* fields
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[StrictStr, dict[str, Any]]] = None
    guided_regex: Optional[StrictStr] = None
    guided_choice: Optional[list[StrictStr]] = None
    guided_grammar: Optional[StrictStr] = None
    # P/D (docs/pd.md): read by the P/D middleware, carried to the engine on the request envelope
    kv_transfer_params: Optional[dict[str, Any]] = None


# ---------------------------------------------------------------------- completions
class CompletionRequest(_SamplingFields):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = 16
    logprobs: Optional[StrictInt] = None
    echo: Optional[StrictBool] = False
    suffix: Optional[StrictStr] = None
    best_of: Optional[StrictInt] = None
    # vLLM's extra: each choice also carries its generated "token_ids" (always so for a model without tokenizer)
    return_token_ids: Optional[StrictBool] = None


# ---------------------------------------------------------------------- chat
class FunctionDef(_Base):
    name: StrictStr
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class ToolDef(_Base):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Base):
    name: StrictStr


class NamedToolChoice(_Base):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(_Base):
    name: StrictStr
    arguments: Union[StrictStr, dict[str, Any]] = "{}"


class ToolCall(_Base):
    id: Optional[StrictStr] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Base):
    type: StrictStr
    text: Optional[StrictStr] = None


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[StrictStr, list[ContentPart]]] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[StrictStr] = None
    reasoning_content: Optional[StrictStr] = None

    @model_validator(mode="after")
    def _content_required(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for role {self.role!r}")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[list[ToolDef]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = True
    reasoning_effort: Optional[Union[StrictStr, StrictInt]] = None
    # DeepSeek / vLLM ways of switching thinking on
    thinking: Optional[Union[StrictBool, dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: Optional[StrictBool] = True
    continue_final_message: Optional[StrictBool] = False
