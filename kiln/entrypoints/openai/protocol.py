"""Request bodies of the OpenAI API that kiln serves, as strict pydantic models.

Strict: a wrong JSON type is a 400 naming the field, never a silent coercion ("5" is not
an integer). Unknown fields are rejected too, so a parameter kiln does not implement can
never be silently ignored; OpenAI fields that only carry bookkeeping (`user`, `metadata`,
`store`, `service_tier`) are accepted and ignored. Field names beyond OpenAI's are vLLM's
extras (`top_k`, `min_p`, `ignore_eos`, ...).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict", "description"}


class _SamplingFields(_Strict):
    """The sampling fields both endpoints share (OpenAI's plus vLLM's extras)."""

    model: str | None = None  # None: the served model
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra: {"json" | "json_object" | "regex" | "choice" | "grammar": ...}.
    structured_outputs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra for P/D disaggregation: {"do_remote_prefill": true} on a decode
    # instance waits for the prompt's KV from the prefill instance (kiln.kv_transfer).
    kv_transfer_params: dict[str, Any] | None = None
    # Accepted and ignored: bookkeeping with no effect on generation.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(_SamplingFields):
    # A string, a batch of strings, token ids, or a batch of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # None: what fits in max_model_len
    logprobs: int | None = None  # top-k per token (0: the sampled token only)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Lenient on extra keys (`name`, `tool_calls`, ...): the chat template decides what
    # it reads; the role and content are still type-checked.
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    max_tokens: int | None = None  # deprecated by OpenAI; max_completion_tokens wins
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True


class LoadLoRAAdapterRequest(_Strict):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Strict):
    """POST /v1/unload_lora_adapter (vLLM's body; `lora_int_id` is accepted and must
    match the adapter's id when given)."""

    lora_name: str
    lora_int_id: int | None = None
