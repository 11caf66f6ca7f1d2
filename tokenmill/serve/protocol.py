"""OpenAI request models (pydantic) and the conversion to SamplingParams.

Field names follow the OpenAI API, plus vLLM's extensions (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, guided_*...), so existing clients work unchanged. Unknown fields are accepted
and ignored, as vLLM does. Responses are plain dicts built in api_server.py / chat.py and encoded with
msgspec (streaming sends one chunk per token per request: pydantic there costs ~10x more CPU).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from tokenmill.http.errors import bad_request, param_of
from tokenmill.kv_transfer.p2p_params import KVTransferParams
from tokenmill.kv_transfer.p2p_params import as_dict as kv_params_as_dict
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs: top-n lists beyond this only bloat responses

_SP_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "stop_token_ids",
              "seed", "logit_bias")


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]  # token counts, top_k, logprobs


# Strict: JSON true/false would otherwise pass as the ids 1 and 0 (bool is an int to Python and to pydantic's
# lax mode), and "5" or 5.0 as 5; checked in pydantic's core, not per id in Python (prompts of 1M ids)
TokenId = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]

# OpenAI's bounds on `metadata` (Responses, chat completions): at most 16 pairs, keys up to 64 characters,
# values up to 512. Unbounded, 100k keys were parsed and echoed back.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def _check_metadata(value: dict[str, str]) -> dict[str, str]:
    if len(value) > MAX_METADATA_PAIRS:
        raise ValueError(f"metadata may have at most {MAX_METADATA_PAIRS} key-value pairs, got {len(value)}")
    for k, v in value.items():
        if len(k) > MAX_METADATA_KEY_CHARS:
            raise ValueError(f"metadata keys may be at most {MAX_METADATA_KEY_CHARS} characters, got {len(k)}")
        if len(v) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"metadata values may be at most {MAX_METADATA_VALUE_CHARS} characters, got {len(v)} "
                             f"for {k!r}")
    return value


Metadata = Annotated[dict[str, str], AfterValidator(_check_metadata)]

# kv_transfer_params: a client's value is checked key by key (a "remote_port": "abc" once reached the engine and
# killed it) and handed on as a plain dict of the keys set
KVTransferParamsField = Annotated[KVTransferParams, AfterValidator(kv_params_as_dict)]


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds the server enforces (its --max-* flags): each one, exceeded, is a 400 naming it.
    The defaults are what `tokenmill serve` starts with."""
    max_n: int = 128                    # OpenAI's own bound on n; never more than --max-num-seqs either
    max_stop_strings: int = 64
    max_stop_string_length: int = 1000
    max_logit_bias: int = 1024
    max_json_schema_bytes: int = 65536
    max_json_schema_depth: int = 32
    # A chat request's tools: OpenAI's own bound on their number, and their total size as JSON (names,
    # descriptions, parameter schemas); each tool's parameters also keep the JSON-schema depth bound above
    max_tools: int = 128
    max_tools_schema_bytes: int = 512 * 1024
    # Prompts in one completions request (as embeddings' inputs: OpenAI's 2048), and prompts x n: each
    # sequence is an engine request; 20000 x 128 of them once froze the server for minutes
    max_prompts_per_request: int = 2048
    max_sequences_per_request: int = 4096
    # The chat template sandbox's budgets for one render (chat_template.py; the same defaults as there): a
    # request's chat_template_kwargs are template variables and can never raise them.
    max_chat_template_chars: int = 2 * 2**20
    chat_template_timeout: float = 2.0  # seconds


_SCALARS = frozenset({int, float, bool, type(None)})


def _check_text(value: Any, where: str) -> None:
    """Refuse strings that cannot be UTF-8 (a lone surrogate such as "\\ud800" is legal JSON): the tokenizer
    and the wire format would fail on them far from here."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where or 'the request'} contains a lone UTF-16 surrogate; send valid UTF-8 "
                             "text") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, where)
            _check_text(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        if set(map(type, value)) <= _SCALARS:  # token ids: one pass in C (a call per id took 0.85 s for 8 MB)
            return
        for i, v in enumerate(value):
            _check_text(v, f"{where}[{i}]")


class OpenAIModel(BaseModel):
    # Non-finite floats (NaN, Infinity, 1e309) are refused for every float field.
    model_config = ConfigDict(extra="allow", populate_by_name=True, allow_inf_nan=False)


class RequestBody(OpenAIModel):
    """A top-level request body: its strings are checked once, here."""

    @model_validator(mode="before")
    @classmethod
    def _utf8(cls, data: Any) -> Any:
        _check_text(data, "")
        return data


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str = "response"
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class SamplingRequest(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: Optional[str] = None
    n: Int64 = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[Int64] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    response_format: Optional[ResponseFormat] = None
    # vLLM extensions
    top_k: Optional[Annotated[int, Field(ge=-1, le=INT64_MAX)]] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[TokenId]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Optional[Count] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    cache_salt: Optional[str] = None
    priority: Int64 = 0  # vLLM's: with --scheduling-policy priority, lower runs first
    # Disaggregated prefill/decode (vLLM's field): its known keys, typed and bounded (kv_transfer/p2p_params.py),
    # passed to the engine request as a dict; see docs/router.md
    kv_transfer_params: Optional[KVTransferParamsField] = None
    metadata: Optional[Metadata] = None  # accepted (bounded) and not used: this server stores nothing

    def _structured(self, limits: RequestLimits) -> Optional[StructuredOutputsParams]:
        rf = self.response_format
        chosen = []
        if rf is not None and rf.type == "json_object":
            chosen.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema",
                                  "response_format")
            chosen.append(("response_format", StructuredOutputsParams(json=json.dumps(rf.json_schema.json_schema))))
        if self.guided_json is not None:
            spec = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
            chosen.append(("guided_json", StructuredOutputsParams(json=spec)))
        if self.guided_regex is not None:
            chosen.append(("guided_regex", StructuredOutputsParams(regex=self.guided_regex)))
        if self.guided_choice is not None:
            if not self.guided_choice:
                raise bad_request("guided_choice must list at least one string", "guided_choice")
            chosen.append(("guided_choice", StructuredOutputsParams(choice=self.guided_choice)))
        if self.guided_grammar is not None:
            chosen.append(("guided_grammar", StructuredOutputsParams(grammar=self.guided_grammar)))
        if len(chosen) > 1:
            raise bad_request(f"set only one of {', '.join(name for name, _ in chosen)}", chosen[1][0])
        if not chosen:
            return None
        name, so = chosen[0]
        from tokenmill.structured import validate  # ~5 ms: only a grammar needs it; `serve --help` imports this module

        check_grammar_size(so, limits, name)
        try:
            validate(so)
        except ValueError as e:
            raise bad_request(str(e), name) from None
        return so

    def _check_limits(self, limits: RequestLimits) -> None:
        if self.n > limits.max_n:
            raise bad_request(f"n must be at most {limits.max_n} (this server's --max-n), got {self.n}", "n")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > limits.max_stop_strings:
            raise bad_request(f"stop may list at most {limits.max_stop_strings} strings (--max-stop-strings), "
                              f"got {len(stops)}", "stop")
        if any(len(x) > limits.max_stop_string_length for x in stops):
            raise bad_request(f"each stop string may be at most {limits.max_stop_string_length} characters "
                              "(--max-stop-string-length)", "stop")
        if len(self.stop_token_ids or ()) > limits.max_stop_strings:
            raise bad_request(f"stop_token_ids may list at most {limits.max_stop_strings} ids "
                              "(--max-stop-strings)", "stop_token_ids")
        if len(self.logit_bias or ()) > limits.max_logit_bias:
            raise bad_request(f"logit_bias may have at most {limits.max_logit_bias} entries (--max-logit-bias), "
                              f"got {len(self.logit_bias)}", "logit_bias")

    def _sampling_params(self, limits: RequestLimits, max_tokens: Optional[int], logprobs: Optional[int],
                         **extra: Any) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        self._check_limits(limits)
        try:
            logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None
        except ValueError:
            raise bad_request("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
        if logit_bias and any(not -100.0 <= v <= 100.0 for v in logit_bias.values()):
            raise bad_request("logit_bias values must be in [-100, 100]", "logit_bias")
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", extra.get("prompt_logprobs",
                                                                                    self.prompt_logprobs))):
            if value is not None and value > MAX_LOGPROBS:
                raise bad_request(f"{name} must be at most {MAX_LOGPROBS}, got {value}", name)
        kw = dict(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs, logit_bias=logit_bias,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_outputs=self._structured(limits))
        kw.update(extra)
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise bad_request(str(e), param_of(str(e), _SP_FIELDS)) from None


def json_depth(value: Any, limit: int, depth: int = 1) -> int:
    """Nesting depth of a parsed JSON value, counting no further than limit + 1."""
    if depth > limit or not isinstance(value, (dict, list)):
        return depth
    children = value.values() if isinstance(value, dict) else value
    return max((json_depth(c, limit, depth + 1) for c in children), default=depth)


def _nonlocal_refs(value: Any) -> list[str]:
    if isinstance(value, dict):
        own = [v for k, v in value.items() if k == "$ref" and not (isinstance(v, str) and v.startswith("#"))]
        return own + [r for v in value.values() for r in _nonlocal_refs(v)]
    if isinstance(value, list):
        return [r for v in value for r in _nonlocal_refs(v)]
    return []


def check_grammar_size(so: StructuredOutputsParams, limits: RequestLimits, param: str) -> None:
    """Bound what the grammar compiler is given; a JSON schema may only reference itself ($ref "#/..."):
    a file:// or http:// reference is refused, never fetched."""
    _, spec = so.key
    if len(spec.encode()) > limits.max_json_schema_bytes:
        raise bad_request(f"the grammar/schema is {len(spec.encode())} bytes; at most "
                          f"{limits.max_json_schema_bytes} are allowed (--max-json-schema-bytes)", param)
    if so.json is None:
        return
    try:
        schema = json.loads(so.json)
    except ValueError as e:
        raise bad_request(f"the JSON schema is not valid JSON: {e}", param) from None
    if json_depth(schema, limits.max_json_schema_depth) > limits.max_json_schema_depth:
        raise bad_request(f"the JSON schema nests deeper than {limits.max_json_schema_depth} levels "
                          "(--max-json-schema-depth)", param)
    refs = _nonlocal_refs(schema)
    if refs:
        raise bad_request(f"the JSON schema references {str(refs[0])[:100]!r}; only references within the "
                          "schema ('#/...') are allowed", param)


class CompletionRequest(SamplingRequest):
    prompt: Union[list[TokenId], list[list[TokenId]], str, list[str]]
    max_tokens: Optional[Int64] = 16
    echo: bool = False
    logprobs: Optional[Int64] = None
    suffix: Optional[str] = None
    best_of: Optional[Int64] = None

    def prompts(self, limits: RequestLimits) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [p]
        if len(p) > limits.max_prompts_per_request:
            raise bad_request(f"prompt lists {len(p)} prompts; at most {limits.max_prompts_per_request} are allowed "
                              "per request (--max-prompts-per-request)", "prompt")
        if len(p) * self.n > limits.max_sequences_per_request:
            raise bad_request(f"{len(p)} prompts x n={self.n} is {len(p) * self.n} sequences; at most "
                              f"{limits.max_sequences_per_request} are allowed per request "
                              "(--max-sequences-per-request)", "n")
        return list(p)

    def to_sampling_params(self, limits: RequestLimits, echo_logprobs: bool) -> SamplingParams:
        if self.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of > limits.max_n:
            raise bad_request(f"best_of must be at most {limits.max_n} (this server's --max-n), got "
                              f"{self.best_of}", "best_of")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (use n)", "best_of")
        extra = {}
        if echo_logprobs:  # echo with logprobs reports the prompt's logprobs too
            extra["prompt_logprobs"] = self.logprobs
        return self._sampling_params(limits, self.max_tokens, self.logprobs, **extra)


class ChatMessage(OpenAIModel):
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # assistant: the calls it made (checked in tools.py)
    tool_call_id: Optional[str] = None                 # tool: the call this message answers


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: Optional[Int64] = None
    max_completion_tokens: Optional[Int64] = None
    logprobs: bool = False
    top_logprobs: Optional[Int64] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None  # a VLM's image processor options (max_pixels, min_pixels)
    tools: Optional[list[dict[str, Any]]] = None     # checked and planned in tools.py
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        return self

    def to_sampling_params(self, limits: RequestLimits,
                           tool_constraint: Optional[StructuredOutputsParams] = None) -> SamplingParams:
        """tool_constraint: the grammar of tool_choice 'required' or a named function (tools.plan_tools)."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if tool_constraint is None:
            return self._sampling_params(limits, max_tokens, logprobs)
        other = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            other.insert(0, "response_format")
        if other:
            raise bad_request(f"{other[0]} cannot be combined with tool_choice 'required' or a named function "
                              "(both constrain the output)", other[0])
        return self._sampling_params(limits, max_tokens, logprobs, structured_outputs=tool_constraint)


class ResponsesTextFormat(OpenAIModel):
    """Responses `text.format`, OpenAI's shape: {type: text} | {type: json_object} | {type: json_schema, name,
    schema, description, strict}. One model rather than a tagged union so that an error names the field
    (text.format.schema), not the union member."""
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None  # OpenAI requires it; nothing here depends on it
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponsesTextFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a format of type json_schema needs schema (a JSON Schema object)")
        return self


class ResponsesText(OpenAIModel):
    """Responses `text`: the output's format (and OpenAI's verbosity hint, accepted and not used)."""
    format: Optional[ResponsesTextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ResponsesRequest(RequestBody):
    """/v1/responses (OpenAI's Responses API, text only). serve/responses.py translates it into a
    ChatCompletionRequest; vLLM's sampling extensions (top_k, seed, stop, ...) pass through as extra fields.
    Input items, tools and tool_choice are checked there, with their position in the error; the rest of what
    the translation reads is typed here (a bad shape is a 400, and the OpenAPI schema shows fuzzers the shape)."""
    model: Optional[str] = None
    input: Union[str, list[Any]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[Annotated[int, Field(ge=1, le=INT64_MAX)]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[ResponsesText] = None
    metadata: Optional[Metadata] = None
    user: Optional[str] = None
    # Stateful features this server refuses (it keeps no responses): see serve/responses.py
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    conversation: Optional[Any] = None
    background: Optional[bool] = None


class LoadLoRAAdapterRequest(RequestBody):
    """POST /v1/load_lora_adapter (vLLM's body)."""
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestBody):
    """POST /v1/unload_lora_adapter (vLLM's body; its lora_int_id is accepted and not needed)."""
    lora_name: str
    lora_int_id: Optional[int] = None


class TokenizeRequest(RequestBody):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None  # rendered into the chat template, as chat completions do
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: Optional[str] = None
    tokens: list[TokenId]


class EmbeddingRequest(RequestBody):
    """/v1/embeddings (OpenAI), plus vLLM's truncate_prompt_tokens. `user` is accepted and ignored."""
    model: Optional[str] = None
    input: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[Int64] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[Int64] = None

    def inputs(self) -> list[Union[str, list[int]]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if not x:
            raise bad_request("input must not be an empty list", "input")
        if isinstance(x[0], int):
            return [x]
        return list(x)
