"""/v1/responses: OpenAI's Responses API (text and function tools) as a translation over the chat path.

One place generates: a Responses request becomes a ChatCompletionRequest (instructions -> a first system
message, input items -> messages, flat function tools -> chat tools, text.format -> response_format), runs
through chat.py, and the chat body or chunk stream is mapped back to Responses output items (`message`,
`function_call`) and typed SSE events (`event: <type>` + `data: {type, sequence_number, ...}`, no [DONE]).

Stateless: this server keeps no responses. The SDK omits `store` unless asked and OpenAI's default is true;
an omitted `store` is taken as false here so that a plain `client.responses.create(model=..., input="hi")`
works. An explicit `store: true`, a `previous_response_id`, a `conversation` or `background: true` is a 400
(send the whole conversation as `input` instead).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.serve.chat import chat_chunks, collect_chat, start_chat
from tokenmill.serve.tools import ToolPlan
from tokenmill.http.disconnect import until_disconnected
from tokenmill.http.errors import APIError, bad_request
from tokenmill.multimodal.chat import part_url
from tokenmill.serve.protocol import ChatCompletionRequest, ResponsesRequest, ResponsesText
from tokenmill.serve.serving import Generation, json_response, now_s, sse, stream_response, with_timing_header

if TYPE_CHECKING:
    from tokenmill.serve.api_server import ServerState

INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# Chat-request fields (vLLM's sampling extensions and ours) a Responses request may carry through unchanged.
PASSTHROUGH = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
               "stop_token_ids", "min_tokens", "ignore_eos", "logit_bias", "skip_special_tokens",
               "include_stop_str_in_output", "cache_salt", "priority", "kv_transfer_params", "chat_template",
               "chat_template_kwargs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# The chat path names its own parameters in errors; a Responses client knows these names instead.
_PARAM_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "response_format": "text.format"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- request: Responses -> chat -------------------------------------------------------------------------
def _refuse_stateful(req: ResponsesRequest) -> None:
    hint = "this server keeps no responses; send the whole conversation as input instead"
    if req.store:
        raise bad_request(f"store: true is not supported: {hint} (omit store or send store: false)", "store")
    if req.previous_response_id is not None:
        raise bad_request(f"previous_response_id is not supported: {hint}", "previous_response_id")
    if req.conversation is not None:
        raise bad_request(f"conversation is not supported: {hint}", "conversation")
    if req.background:
        raise bad_request("background: true is not supported: this server keeps no responses to poll",
                          "background")


def _text(content: Any, where: str, images: bool = False) -> Any:
    """A message's content as chat content: the string, or its parts as chat parts: text parts, and (a message's
    content, `images`) input_image parts as image_url parts, which the chat path checks and fetches as its own."""
    if isinstance(content, str):
        return content
    kinds = "input_text and input_image parts" if images else "input_text parts"
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of {kinds}", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and images:
            parts.append({"type": "image_url", "image_url": {"url": _image_url(part, f"{where}[{j}]")}})
        else:
            raise bad_request(f"{where}[{j}]: only {kinds} (and output_text) are supported, got "
                              f"{kind if kind is not None else type(part).__name__!r}", where)
    return parts


def _image_url(part: dict, where: str) -> str:
    """An input_image part's URL (a string in the Responses API, not chat's {url} object)."""
    if part.get("file_id") is not None:
        raise bad_request(f"{where}: file_id images are not supported (this server keeps no files); send "
                          "image_url as a data:, file:// or http(s) URL", where)
    url = part_url(part)
    if url is None:
        raise bad_request(f"{where}: an input_image part needs image_url (a data:, file:// or http(s) URL)", where)
    return url


def _field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{name} must be a string", f"{where}.{name}")
    return value


def _add_item(messages: list[dict], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object: a message, function_call or function_call_output item", where)
    kind = item.get("type", "message")
    if kind == "message":
        if item.get("role") not in INPUT_ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(INPUT_ROLES)}, got {item.get('role')!r}",
                              f"{where}.role")
        messages.append({"role": item["role"],
                         "content": _text(item.get("content"), f"{where}.content", images=True)})
    elif kind == "function_call":  # joins the assistant turn it follows, as one chat message with tool_calls
        call = {"id": _field(item, "call_id", where), "type": "function",
                "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
        if messages and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                         "content": _text(item.get("output"), f"{where}.output")})
    else:
        raise bad_request(f"{where}.type {kind!r} is not supported; input items may be message, function_call "
                          "or function_call_output", f"{where}.type")


def input_messages(input: Any, instructions: Optional[str]) -> list[dict]:
    """Chat messages for a Responses input: instructions first (as a system message), then the items."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(input, str):
        return messages + [{"role": "user", "content": input}]
    if not input:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    for i, item in enumerate(input):
        _add_item(messages, item, f"input[{i}]")
    return messages


def chat_tool(tool: Any, i: int) -> dict:
    """A flat Responses function tool ({type, name, parameters, ...}) as a chat tool ({type, function})."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise bad_request(f"tools[{i}]: only function tools are supported, got {kind!r}", f"tools[{i}]")
    if not isinstance(tool.get("name"), str):
        raise bad_request(f"tools[{i}].name must be a string (Responses function tools are flat: "
                          "{type: function, name, parameters})", f"tools[{i}].name")
    keys = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in keys if tool.get(k) is not None}}


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice  # none / auto / required: the chat path checks them
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {type: function, name}", "tool_choice")


def chat_response_format(text: Optional[ResponsesText]) -> Optional[dict]:
    """text.format (typed, so already one of OpenAI's three shapes) as a chat response_format."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "description": fmt.description,
                                                   "schema": fmt.json_schema, "strict": fmt.strict}}


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    _refuse_stateful(req)
    body = {k: v for k, v in (req.model_extra or {}).items() if k in PASSTHROUGH}
    body.update(model=req.model, messages=input_messages(req.input, req.instructions), temperature=req.temperature,
                top_p=req.top_p, max_completion_tokens=req.max_output_tokens, stream=req.stream,
                response_format=chat_response_format(req.text))
    if req.stream:
        body["stream_options"] = {"include_usage": True}  # the final response carries usage
    if req.tools is not None:
        body["tools"] = [chat_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise bad_request(f"{where}: {str(err.get('msg')).removeprefix('Value error, ')}", where or None) from None


# -- response: chat -> Responses ------------------------------------------------------------------------
@dataclass
class ResponseContext:
    """What every response object of one request echoes."""
    req: ResponsesRequest
    model: str
    prefix_caching: bool = True  # whether the prompt tokens computed are written where later requests find them
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=now_s)


def responses_usage(usage: Optional[dict], prefix_caching: bool) -> Optional[dict]:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    written = usage["prompt_tokens"] - cached if prefix_caching else 0
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _echo_text(text: Optional[ResponsesText]) -> dict:
    """The request's text config as OpenAI echoes it: what was sent, its format defaulting to text."""
    echoed = text.model_dump(by_alias=True, exclude_none=True) if text is not None else {}
    return {**echoed, "format": echoed.get("format") or {"type": "text"}}


def response_object(ctx: ResponseContext, status: str, output: list[dict], usage: Optional[dict] = None,
                    incomplete: Optional[dict] = None, error: Optional[dict] = None) -> dict:
    req = ctx.req
    return {"id": ctx.id, "object": "response", "created_at": ctx.created_at, "status": status, "error": error,
            "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": ctx.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "text": _echo_text(req.text),
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "truncation": "disabled",
            "usage": responses_usage(usage, ctx.prefix_caching), "user": req.user, "metadata": req.metadata or {}}


def finish_status(finish_reason: Optional[str]) -> tuple[str, Optional[dict]]:
    """(response status, incomplete_details) for a chat finish_reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, status: str, content: list[dict]) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    """A reasoning model's thinking (--reasoning-parser), as OpenAI's Responses API returns open models' reasoning."""
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(message: dict, finish_reason: Optional[str]) -> list[dict]:
    """A chat message as output items: its reasoning (if any) as a reasoning item, its text as a message item
    (also when empty and nothing else came), then one function_call item per tool call."""
    status = "incomplete" if finish_reason == "length" else "completed"
    text, calls = message.get("content") or "", message.get("tool_calls") or []
    items = [reasoning_item(new_id("rs"), message["reasoning_content"], status)] \
        if message.get("reasoning_content") else []
    items += [message_item(new_id("msg"), status, [text_part(text)])] if text or not calls else []
    for c in calls:
        items.append(function_call_item(new_id("fc"), c.get("id") or new_id("call"), c["function"]["name"],
                                        c["function"].get("arguments") or "", status))
    return items


def from_chat_body(ctx: ResponseContext, body: dict) -> dict:
    choice = body["choices"][0]
    status, incomplete = finish_status(choice["finish_reason"])
    out = response_object(ctx, status, output_items(choice["message"], choice["finish_reason"]), body["usage"],
                          incomplete)
    if "kv_transfer_params" in body:  # a disaggregated prefill phase: the router reads it
        out["kv_transfer_params"] = body["kv_transfer_params"]
    return out


# -- streaming ------------------------------------------------------------------------------------------
@dataclass
class _OpenText:
    index: int
    id: str
    text: str = ""


@dataclass
class _OpenCall:
    index: int
    id: str
    call_id: str
    name: str
    arguments: str = ""


class StreamTranslator:
    """Chat completion chunks (dicts) in, Responses stream events out: start(), feed(chunk) per chunk, then
    finish() (or fail(error) when generation failed mid-stream)."""

    def __init__(self, ctx: ResponseContext) -> None:
        self.ctx = ctx
        self.seq = 0
        self.output: list[Optional[dict]] = []  # finished items by output index (None while open)
        self.reasoning: Optional[_OpenText] = None  # the open reasoning item (--reasoning-parser)
        self.text: Optional[_OpenText] = None
        self.calls: dict[int, _OpenCall] = {}  # by the chat tool call's index
        self.answered = False  # a message or function_call item was opened
        self.finish_reason: Optional[str] = None
        self.usage: Optional[dict] = None

    def _event(self, kind: str, **fields: Any) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        r = response_object(self.ctx, "in_progress", [])
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def feed(self, chunk: dict) -> list[dict]:
        events: list[dict] = []
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._reasoning_delta(delta["reasoning_content"])
            if delta.get("content"):
                events += self._text_delta(delta["content"])
            for tc in delta.get("tool_calls") or []:
                events += self._call_delta(tc)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[dict]:
        events = self._text_delta("") if not self.answered else []  # no answer: an empty message, as unstreamed
        events += self._close_all()
        status, incomplete = finish_status(self.finish_reason)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        r = response_object(self.ctx, status, list(self.output), self.usage, incomplete)
        return events + [self._event(kind, response=r)]

    def fail(self, e: APIError) -> list[dict]:
        error = {"code": e.code or ("server_error" if e.status >= 500 else "invalid_request"), "message": e.message}
        r = response_object(self.ctx, "failed", [i for i in self.output if i is not None], self.usage, error=error)
        return [self._event("response.failed", response=r)]

    def _item_status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def _reasoning_delta(self, delta: str) -> list[dict]:
        events = []
        if self.reasoning is None:
            r = self.reasoning = _OpenText(len(self.output), new_id("rs"))
            self.output.append(None)
            events.append(self._event("response.output_item.added", output_index=r.index,
                                      item=reasoning_item(r.id, "", "in_progress")))
        r = self.reasoning
        r.text += delta
        return events + [self._event("response.reasoning_text.delta", item_id=r.id, output_index=r.index,
                                     content_index=0, delta=delta)]

    def _close_reasoning(self) -> list[dict]:
        r, self.reasoning = self.reasoning, None
        if r is None:
            return []
        item = self.output[r.index] = reasoning_item(r.id, r.text, self._item_status())
        return [self._event("response.reasoning_text.done", item_id=r.id, output_index=r.index, content_index=0,
                            text=r.text),
                self._event("response.output_item.done", output_index=r.index, item=item)]

    def _text_delta(self, delta: str) -> list[dict]:
        events = []
        if self.text is None:
            events += self._close_reasoning() + self._close_calls()
            self.answered = True
            t = self.text = _OpenText(len(self.output), new_id("msg"))
            self.output.append(None)
            events += [self._event("response.output_item.added", output_index=t.index,
                                   item=message_item(t.id, "in_progress", [])),
                       self._event("response.content_part.added", item_id=t.id, output_index=t.index,
                                   content_index=0, part=text_part(""))]
        t = self.text
        if delta:
            t.text += delta
            events.append(self._event("response.output_text.delta", item_id=t.id, output_index=t.index,
                                      content_index=0, delta=delta, logprobs=[]))
        return events

    def _call_delta(self, tc: dict) -> list[dict]:
        events = []
        fn = tc.get("function") or {}
        call = self.calls.get(tc.get("index", 0))
        if call is None:
            events += self._close_reasoning() + self._close_text()
            self.answered = True
            call = _OpenCall(len(self.output), new_id("fc"), tc.get("id") or new_id("call"), fn.get("name") or "")
            self.calls[tc.get("index", 0)] = call
            self.output.append(None)
            events.append(self._event("response.output_item.added", output_index=call.index,
                                      item=function_call_item(call.id, call.call_id, call.name, "", "in_progress")))
        if fn.get("arguments"):
            call.arguments += fn["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=call.id,
                                      output_index=call.index, delta=fn["arguments"]))
        return events

    def _close_text(self) -> list[dict]:
        t, self.text = self.text, None
        if t is None:
            return []
        part = text_part(t.text)
        item = self.output[t.index] = message_item(t.id, self._item_status(), [part])
        return [self._event("response.output_text.done", item_id=t.id, output_index=t.index, content_index=0,
                            text=t.text, logprobs=[]),
                self._event("response.content_part.done", item_id=t.id, output_index=t.index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=t.index, item=item)]

    def _close_calls(self) -> list[dict]:
        events = []
        for call in self.calls.values():
            item = self.output[call.index] = function_call_item(call.id, call.call_id, call.name, call.arguments,
                                                                self._item_status())
            events += [self._event("response.function_call_arguments.done", item_id=call.id,
                                   output_index=call.index, arguments=call.arguments),
                       self._event("response.output_item.done", output_index=call.index, item=item)]
        self.calls = {}
        return events

    def _close_all(self) -> list[dict]:
        return self._close_reasoning() + self._close_text() + self._close_calls()


def sse_event(event: dict) -> bytes:
    return b"event: " + event["type"].encode() + b"\n" + sse(event)


async def _events(state: "ServerState", chat: ChatCompletionRequest, gen: Generation, plan: ToolPlan,
                  ctx: ResponseContext) -> AsyncIterator[bytes]:
    t = StreamTranslator(ctx)
    for e in t.start():
        yield sse_event(e)
    try:
        async for chunk in chat_chunks(state, chat, gen, ctx.id, plan):
            for e in t.feed(chunk):
                yield sse_event(e)
    except APIError as err:  # headers are gone: the stream ends with response.failed
        for e in t.fail(err):
            yield sse_event(e)
        return
    for e in t.finish():
        yield sse_event(e)


# -- the handler ----------------------------------------------------------------------------------------
async def _admit(state: "ServerState", chat: ChatCompletionRequest, rid: str) -> tuple[Generation, ToolPlan]:
    try:
        return await start_chat(state, chat, rid)
    except APIError as e:
        # a chat message's index is not its input item's (instructions, merged function calls): name `input`
        param = "input" if (e.param or "").startswith("messages[") else _PARAM_NAMES.get(e.param)
        if param is None:
            raise
        raise APIError(e.status, e.message, param, e.code, e.type, e.headers) from None


async def create_response(state: "ServerState", req: ResponsesRequest, raw: Request) -> Response:
    chat = to_chat_request(req)
    ctx = ResponseContext(req, state.model_name, state.config.cache.enable_prefix_caching)
    gen, plan = await _admit(state, chat, ctx.id)
    if req.stream:
        return stream_response(_events(state, chat, gen, plan, ctx), gen)
    try:
        body = await until_disconnected(raw, collect_chat(state, chat, gen, ctx.id, plan))
    finally:
        gen.close()
    if body is None:
        return Response(status_code=499)
    return with_timing_header(json_response(from_chat_body(ctx, body)), gen)
