"""/v1/chat/completions: chat template rendering, chat-shaped logprobs, responses and stream chunks."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional, Union

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.chat_template import render_chat_template
from tokenmill.http.disconnect import until_disconnected
from tokenmill.http.errors import bad_request
from tokenmill.outputs import Logprob
from tokenmill.sampling_params import SamplingParams
from tokenmill.serve.protocol import ChatCompletionRequest, ChatMessage, RequestLimits
from tokenmill.multimodal.chat import IMAGE_PART_TYPES, template_content
from tokenmill.serve.images import attach_images, image_url, image_urls
from tokenmill.serve.serving import (SSE_DONE, Generation, Prompt, check_text_length, json_response, now_s,
                                     off_loop, random_id, sse, stream_response, with_kv_transfer_params,
                                     with_timing_header)
from tokenmill.serve.tools import (ToolCallStream, ToolPlan, check_tool_count, parse_tools, plan_tools,
                                  template_messages)

if TYPE_CHECKING:
    from tokenmill.serve.api_server import ServerState

logger = logging.getLogger("tokenmill")

ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _content(m: ChatMessage, i: int) -> Union[str, list[dict]]:
    """The content the template sees (multimodal/chat.py: text parts joined, or with images the parts in order);
    a part that is neither text nor an image with a URL is a 400 naming it."""
    c = m.content
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    for j, part in enumerate(c):
        if part.get("type") in IMAGE_PART_TYPES:
            image_url(part, f"messages[{i}].content[{j}]")
        elif part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"messages[{i}].content[{j}]: only text and image_url content parts are supported "
                              f"(got type {part.get('type')!r})", f"messages[{i}].content")
    return template_content(c)[0]


def render_chat(tokenizer, messages: list[ChatMessage], *, chat_template: Optional[str] = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: Optional[dict[str, Any]] = None, tools: Optional[list[dict]] = None,
                limits: RequestLimits = RequestLimits()) -> Prompt:
    """Apply the chat template (request's, else the server's --chat-template, else the tokenizer's) and
    tokenize the result without adding special tokens again. `tools`: OpenAI function tools for the
    template (templates that know tools list them). `template_kwargs` (the request's chat_template_kwargs)
    are template variables only; the render's budgets come from `limits` (the server's flags)."""
    if not messages:
        raise bad_request("messages must contain at least one message", "messages")
    conv = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise bad_request(f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}", f"messages[{i}].role")
        d = m.model_dump(exclude_none=True)
        d["content"] = _content(m, i)
        conv.append(d)
    conv = template_messages(conv)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise bad_request("this model has no chat template, so it cannot serve chat completions; pass "
                          "chat_template in the request, start the server with --chat-template, or use "
                          "/v1/completions", "messages")
    if add_generation_prompt and continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true",
                          "continue_final_message")
    try:  # render_chat_template: a bounded sandbox, request templates are untrusted
        text = render_chat_template(tokenizer, conv, chat_template=template,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, tools=tools,
                                    template_kwargs=template_kwargs, max_chars=limits.max_chat_template_chars,
                                    timeout_s=limits.chat_template_timeout)
    except Exception as e:  # noqa: BLE001 - jinja errors are the request's (or template's) fault
        raise bad_request(f"cannot apply the chat template: {type(e).__name__}: {e}", "messages") from None
    return Prompt(text, tokenizer(text, add_special_tokens=False).input_ids)


async def render_request_chat(state: "ServerState", req, tools: Optional[list[dict]] = None) -> Prompt:
    """render_chat for a request (chat completion or /tokenize), in a worker thread: templates and
    tokenization of long conversations take seconds that the event loop must not lose."""
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            check_text_length(state, m.content, f"messages[{i}].content")
    prompt = await off_loop(render_chat, state.tokenizer, req.messages,
                            chat_template=req.chat_template or state.chat_template,
                            add_generation_prompt=req.add_generation_prompt,
                            continue_final_message=req.continue_final_message,
                            template_kwargs=req.chat_template_kwargs, tools=tools, limits=state.limits)
    check_text_length(state, prompt.text, "messages")
    return await attach_images(state, prompt, image_urls(req.messages), getattr(req, "mm_processor_kwargs", None))


def _lp_entry(token: str, lp: Logprob) -> dict:
    return {"token": token, "logprob": max(lp.logprob, -9999.0), "bytes": list(token.encode("utf-8", "replace"))}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int) -> dict:
    """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    content = []
    for tid, d in zip(token_ids, logprobs):
        lp = d[tid]
        entry = _lp_entry(lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([tid]), lp)
        top = sorted(d.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)[:top_n]
        entry["top_logprobs"] = [_lp_entry(x.decoded_token if x.decoded_token is not None else tokenizer.decode([t]), x)
                                 for t, x in top]
        content.append(entry)
    return {"content": content}


def _plan_tools(state: "ServerState", req: ChatCompletionRequest) -> ToolPlan:
    return plan_tools(parse_tools(req.tools, state.limits), req.tool_choice, req.parallel_tool_calls,
                      auto_parser=state.tool_parser, limits=state.limits)


async def plan_request_tools(state: "ServerState", req: ChatCompletionRequest) -> ToolPlan:
    """The request's tools and tool_choice against this server's --tool-call-parser (400 when unservable).
    Checking up to --max-tools-schema-bytes of tools and compiling their constraint takes long enough to
    stall every other stream, so it runs in a worker thread; too many tools are refused before that."""
    if req.tools is None and req.tool_choice is None:
        return ToolPlan("none")
    check_tool_count(req.tools, state.limits)
    return await off_loop(_plan_tools, state, req)


async def template_tools(state: "ServerState", tools: Optional[list]) -> Optional[list[dict]]:
    """A request's tools as the chat template reads them (/tokenize), checked as chat completions checks them."""
    if tools is None:
        return None
    check_tool_count(tools, state.limits)
    return [t.to_template() for t in await off_loop(parse_tools, tools, state.limits)] or None


async def start_chat(state: "ServerState", req: ChatCompletionRequest, rid: str) -> tuple[Generation, ToolPlan]:
    """Validate, render and admit a chat request as engine request `rid` (the Responses API enters here too);
    the tool plan reads the generated text back into content and tool calls."""
    lora = state.check_model(req.model)
    plan = await plan_request_tools(state, req)
    params = req.to_sampling_params(state.limits, plan.constraint)
    if state.reasoning is not None and state.reasoning.keep_special_tokens:  # harmony's channels are special tokens
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    prompt = await render_request_chat(state, req, plan.template_tools())
    params = _grammar_after_reasoning(state, params, prompt)
    return Generation(state, rid, [prompt], params, req.cache_salt, req.kv_transfer_params, req.priority,
                      lora), plan


def _grammar_after_reasoning(state: "ServerState", params: SamplingParams, prompt: Prompt) -> SamplingParams:
    """With --reasoning-parser, a grammar (response_format, structured_outputs, a tool constraint) constrains
    the answer, not the thinking: the engine starts it once the model has generated the closing tag, unless
    the prompt closed the reasoning already (qwen3 with enable_thinking false)."""
    so, parser = params.structured_outputs, state.reasoning
    if so is None or parser is None or parser.state_after(prompt.text) == "answer":
        return params
    end = state.tokenizer.encode(parser.end, add_special_tokens=False)
    return msgspec.structs.replace(params, structured_outputs=msgspec.structs.replace(so, reasoning_end=end))


async def create_chat_completion(state: "ServerState", req: ChatCompletionRequest, raw: Request) -> Response:
    rid = random_id("chatcmpl")
    gen, plan = await start_chat(state, req, rid)
    if req.stream:
        return stream_response(_sse(chat_chunks(state, req, gen, rid, plan)), gen)
    try:
        body = await until_disconnected(raw, collect_chat(state, req, gen, rid, plan))
    finally:
        gen.close()
    return with_timing_header(json_response(body), gen) if body is not None else Response(status_code=499)


async def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        yield sse(chunk)
    yield SSE_DONE


async def collect_chat(state: "ServerState", req: ChatCompletionRequest, gen: Generation, rid: str,
                       plan: ToolPlan) -> dict:
    """The chat.completion body of an admitted request, once it has finished."""
    top_n = req.top_logprobs or 0
    n = gen.params.n
    texts, tokens = [""] * n, [[] for _ in range(n)]
    lps: list[list] = [[] for _ in range(n)]
    finish: list[Optional[str]] = [None] * n
    stop: list[Any] = [None] * n
    async for _, ro in gen:
        for c in ro.outputs:
            texts[c.index] += c.text
            tokens[c.index] += c.token_ids
            if c.logprobs:
                lps[c.index] += c.logprobs
            if c.finish_reason is not None:
                finish[c.index], stop[c.index] = c.finish_reason, c.stop_reason
    choices = []
    for i in range(n):
        logprobs = chat_logprobs(state.tokenizer, tokens[i], lps[i], top_n) if req.logprobs else None
        prompt = gen.prompts[0].text
        reasoning, answer = state.reasoning.split(texts[i], prompt) if state.reasoning else (None, texts[i])
        content, calls = plan.extract(answer) if answer is not None else (None, [])
        message = {"role": "assistant", "content": content, "refusal": None,
                   "tool_calls": [c.to_openai() for c in calls]}
        if state.reasoning:
            message.update(reasoning_content=reasoning, reasoning=reasoning)
        choices.append({"index": i, "message": message, "logprobs": logprobs,
                        "finish_reason": plan.finish_reason(finish[i], bool(calls)), "stop_reason": stop[i]})
    return with_kv_transfer_params(
        {"id": rid, "object": "chat.completion", "created": now_s(), "model": req.model or state.model_name,
         "choices": choices, "usage": gen.usage(), "system_fingerprint": None}, gen)


def _stream_choices(c, text: str, tools: Optional[ToolCallStream], logprobs: Optional[dict]) -> list[dict]:
    """The chunk choices for one engine output of one choice: its answer text as content, or (tools) as the
    content and tool_call deltas the parser lets out; the finish reason last."""
    if tools is None:
        choice = {"index": c.index, "delta": {"content": text} if text or c.finish_reason is None else {},
                  "logprobs": logprobs, "finish_reason": c.finish_reason}
        return [choice]
    deltas = tools.feed(text) + (tools.finish() if c.finish_reason is not None else [])
    choices = [{"index": c.index, "delta": d, "logprobs": logprobs if k == 0 else None, "finish_reason": None}
               for k, d in enumerate(deltas)]
    if c.finish_reason is not None or (not choices and logprobs is not None):
        choices.append({"index": c.index, "delta": {}, "logprobs": None if deltas else logprobs,
                        "finish_reason": ToolPlan.finish_reason(c.finish_reason, tools.called)})
    return choices


async def chat_chunks(state: "ServerState", req: ChatCompletionRequest, gen: Generation,
                      rid: str, plan: ToolPlan) -> AsyncIterator[dict]:
    """The chat.completion.chunk bodies of an admitted streaming request (without the SSE framing)."""
    top_n = req.top_logprobs or 0
    created = now_s()
    model = req.model or state.model_name  # an adapter answers under its own name
    opts = req.stream_options
    include_usage = opts is not None and opts.include_usage
    continuous = include_usage and opts.continuous_usage_stats

    def chunk(choices: list[dict]) -> dict:
        c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
        if continuous:
            c["usage"] = gen.usage()
        return c

    started = [False] * gen.params.n
    tool_streams = [plan.stream() for _ in range(gen.params.n)]
    thinking = ([state.reasoning.stream(gen.prompts[0].text) for _ in range(gen.params.n)]
                if state.reasoning else None)
    async for _, ro in gen:
        for c in ro.outputs:
            if not c.text and not c.token_ids and c.finish_reason is None:
                continue
            if not started[c.index]:
                # The role chunk leads each choice, but only once the model has produced something, as vLLM's
                # and OpenAI's streams do: clients (vllm bench serve, aiperf) time the first token by it.
                started[c.index] = True
                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            logprobs = (chat_logprobs(state.tokenizer, c.token_ids, c.logprobs or [], top_n)
                        if req.logprobs else None)
            text = c.text
            if thinking is not None:
                reasoning, text = thinking[c.index].feed(c.text, last=c.finish_reason is not None)
                if reasoning:
                    yield chunk([{"index": c.index, "delta": {"reasoning_content": reasoning, "reasoning": reasoning},
                                  "logprobs": logprobs, "finish_reason": None}])
                    logprobs = None
                if not text and c.finish_reason is None and logprobs is None:
                    continue
            for choice in _stream_choices(c, text, tool_streams[c.index], logprobs):
                if choice["finish_reason"] is not None:
                    choice["stop_reason"] = c.stop_reason
                    yield with_kv_transfer_params(chunk([choice]), gen)
                else:
                    yield chunk([choice])
    if include_usage:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": gen.usage()}
