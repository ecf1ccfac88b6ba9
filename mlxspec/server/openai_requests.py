"""The OpenAI surface's request bodies: every field it reads, declared (so /openapi.json and
the schema fuzzer see them), the OpenAI fields accepted with no effect (``IGNORED``, each with
why) and a 400 naming any other field (see ``contract.py``).

Besides OpenAI's own fields they take the extras other OpenAI-compatible servers take, under
those servers' names: ``top_k``, ``min_p``, ``repetition_penalty`` and
``repetition_context_size`` (mlx-lm's and vLLM's), ``guided_json`` / ``guided_regex`` /
``guided_grammar`` and ``chat_template_kwargs`` (vLLM's), and our ``speculation``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..options import MAX_SEED
from .contract import RequestBody, limit_text

# OpenAI fields a client may send that change nothing in what is generated here
OPENAI_IGNORED = {
    "user": "an end-user id for OpenAI's abuse monitoring: nothing is monitored here",
    "safety_identifier": "the same, under its newer name",
    "store": "whether OpenAI keeps the completion for its dashboard: nothing is kept",
    "metadata": "tags for stored completions: nothing is stored",
    "service_tier": "OpenAI's billing tier: there is one here",
    "prompt_cache_key": "a hint for OpenAI's prompt caching: the prefix cache finds shared prefixes itself",
}


class Message(BaseModel):
    # messages carry fields of their own (reasoning_content, refusal, audio...): those the
    # template uses are read, the rest of a past turn is left out of the prompt
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[dict], None] = None
    tool_calls: Optional[list[dict]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")
    strict: Optional[bool] = None  # strict or not, the schema is enforced


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StreamOptions(RequestBody):
    IGNORED = {"include_obfuscation": "pads stream chunks against a length side channel of OpenAI's; "
                                      "a local stream has none to hide"}
    include_usage: Optional[bool] = None
    include_speculation: Optional[bool] = Field(
        None, description='chat streams: each text chunk carries "x_mlxspec": {"drafted": [[start, end], ...]}, '
                          "the character spans of its delta that came from accepted draft tokens")


class SamplingFields(RequestBody):
    IGNORED = OPENAI_IGNORED
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: float = Field(1.0, description=limit_text("temperature", "openai"))
    top_p: float = Field(1.0, description=limit_text("top_p", "openai"))
    top_k: int = Field(0, description=limit_text("top_k", "openai"))
    min_p: float = Field(0.0, description=limit_text("min_p", "openai"))
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, description="1: one choice per request")
    speculation: Optional[dict] = None
    logprobs: Union[bool, int, None] = None
    # penalties over the last repetition_context_size tokens of prompt + output (mlx-lm's)
    frequency_penalty: float = Field(0.0, description=limit_text("frequency_penalty", "openai"))
    presence_penalty: float = Field(0.0, description=limit_text("presence_penalty", "openai"))
    repetition_penalty: Optional[float] = Field(None, description=limit_text("repetition_penalty", "openai"))
    repetition_context_size: Optional[int] = Field(None, description=limit_text("penalty_window", "openai"))
    logit_bias: Optional[dict[str, float]] = Field(None, description="token id -> added to its logit; "
                                                                     + limit_text("logit_bias", "openai"))
    # constrained output: one of these at most (a forced tool_choice counts as one)
    response_format: Optional[ResponseFormat] = None
    guided_json: Union[dict, str, None] = Field(None, description="a JSON schema (vLLM's name)")
    guided_regex: Optional[str] = Field(None, description="a regular expression (vLLM's name)")
    guided_grammar: Optional[str] = Field(None, description="a Lark grammar (vLLM's name)")


class ChatRequest(SamplingFields):
    messages: list[Message]
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = Field(None, description="false: at most one tool call comes back")
    top_logprobs: Optional[int] = None
    modalities: Optional[list[Literal["text"]]] = Field(None, description='["text"]: text is all this server writes')
    chat_template_kwargs: Optional[dict] = None
    reasoning: Any = None  # "on" | "off" | "auto" or {"enabled": bool, "effort": str, "max_tokens": int}
    reasoning_effort: Optional[str] = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int]]
    max_tokens: Optional[int] = 16
    echo: bool = False
    best_of: Optional[int] = Field(None, description="1: one completion per request")
    suffix: Optional[str] = Field(None, description="the text after the completion: fill-in-the-middle "
                                                    "with the model's FIM tokens (a 400 where it has none)")
