"""/v1/completions: prompts as text or token ids (one or many), echo, completion-shaped logprobs."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import Response

from tokenmill.http.disconnect import until_disconnected
from tokenmill.http.errors import bad_request
from tokenmill.outputs import Logprob
from tokenmill.serve.protocol import CompletionRequest
from tokenmill.serve.serving import (SSE_DONE, Generation, Prompt, check_text_length, json_response, now_s,
                                     off_loop, random_id, sse, stream_response, with_kv_transfer_params,
                                     with_timing_header)

if TYPE_CHECKING:
    from tokenmill.serve.api_server import ServerState


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[Optional[dict[int, Logprob]]],
                        num_top: int, initial_offset: int = 0) -> dict:
    """OpenAI/vLLM completions shape: parallel lists tokens, token_logprobs, top_logprobs, text_offset.
    top_logprobs holds the chosen token and the top `num_top` (up to num_top + 1 entries, as OpenAI);
    a position without logprobs (the first prompt token under echo) has None."""
    tokens: list[str] = []
    token_lps: list[Optional[float]] = []
    tops: list[Optional[dict[str, float]]] = []
    offsets: list[int] = []
    offset = initial_offset
    for tid, d in zip(token_ids, logprobs):
        if d is None:
            tok = tokenizer.decode([tid])
            token_lps.append(None)
            tops.append(None)
        else:
            lp = d[tid]
            tok = lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([tid])
            token_lps.append(max(lp.logprob, -9999.0))
            top: dict[str, float] = {}
            for j, (t, x) in enumerate(d.items()):
                if j > num_top:
                    break
                top[x.decoded_token if x.decoded_token is not None else tokenizer.decode([t])] = max(x.logprob, -9999.0)
            tops.append(top)
        tokens.append(tok)
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def _prompts(state: "ServerState", req: CompletionRequest) -> list[Prompt]:
    """Text prompts are tokenized together in one worker thread: 2048 of them one by one took 2048 hops
    through the event loop."""
    raw = req.prompts(state.limits)
    texts = [p for p in raw if isinstance(p, str)]
    for p in texts:
        check_text_length(state, p)
    ids = iter(await off_loop(lambda: state.tokenizer(texts).input_ids) if texts else ())
    out, context = [], state.config.model.max_model_len
    for i, p in enumerate(raw):
        if isinstance(p, str):
            out.append(Prompt(p, next(ids)))
        else:
            if not p:
                raise bad_request(f"prompt {i} is an empty list of token ids", "prompt")
            if len(p) > context:  # before any per-id check: an 8 MB body carries ~4M ids
                raise bad_request(f"prompt {i} has {len(p)} tokens, more than the model's context length of "
                                  f"{context}", "prompt")
            out.append(Prompt(None, list(p)))
    return out


async def create_completion(state: "ServerState", req: CompletionRequest, raw: Request) -> Response:
    lora = state.check_model(req.model)
    prompts = await _prompts(state, req)
    want_lp = req.logprobs is not None
    params = req.to_sampling_params(state.limits, echo_logprobs=req.echo and want_lp)
    rid = random_id("cmpl")
    gen = Generation(state, rid, prompts, params, req.cache_salt, req.kv_transfer_params, req.priority, lora)
    if req.stream:
        return stream_response(_stream(state, req, gen, rid), gen)
    try:
        result = await until_disconnected(raw, _collect(state, req, gen, rid))
    finally:
        gen.close()
    return with_timing_header(result, gen) if result is not None else Response(status_code=499)


def _prompt_text(state: "ServerState", p: Prompt) -> str:
    return p.text if p.text is not None else state.tokenizer.decode(p.token_ids)


async def _collect(state: "ServerState", req: CompletionRequest, gen: Generation, rid: str) -> Response:
    n = gen.params.n
    total = len(gen.prompts) * n
    texts, tokens = [""] * total, [[] for _ in range(total)]
    lps: list[list] = [[] for _ in range(total)]
    finish: list[Optional[str]] = [None] * total
    stop: list[Any] = [None] * total
    prompt_lps: list[list] = [[] for _ in gen.prompts]
    async for pi, ro in gen:
        if ro.prompt_logprobs:
            prompt_lps[pi] += ro.prompt_logprobs
        for c in ro.outputs:
            k = pi * n + c.index
            texts[k] += c.text
            tokens[k] += c.token_ids
            if c.logprobs:
                lps[k] += c.logprobs
            if c.finish_reason is not None:
                finish[k], stop[k] = c.finish_reason, c.stop_reason
    choices = []
    for k in range(total):
        p = gen.prompts[k // n]
        text, ids, lp = texts[k], tokens[k], lps[k]
        if req.echo:
            text = _prompt_text(state, p) + text
            ids = p.token_ids + ids
            lp = prompt_lps[k // n] + lp
        logprobs = completion_logprobs(state.tokenizer, ids, lp, req.logprobs) if req.logprobs is not None else None
        choice = {"index": k, "text": text, "logprobs": logprobs, "finish_reason": finish[k], "stop_reason": stop[k]}
        if gen.params.prompt_logprobs is not None and not req.echo:
            choice["prompt_logprobs"] = [None if d is None else {str(t): {"logprob": x.logprob, "rank": x.rank,
                                                                          "decoded_token": x.decoded_token}
                                                                 for t, x in d.items()}
                                         for d in prompt_lps[k // n]]
        choices.append(choice)
    return json_response(with_kv_transfer_params(
        {"id": rid, "object": "text_completion", "created": now_s(), "model": req.model or state.model_name,
         "choices": choices, "usage": gen.usage(), "system_fingerprint": None}, gen))


async def _stream(state: "ServerState", req: CompletionRequest, gen: Generation, rid: str) -> AsyncIterator[bytes]:
    created = now_s()
    model = req.model or state.model_name  # an adapter answers under its own name
    n = gen.params.n
    opts = req.stream_options
    include_usage = opts is not None and opts.include_usage
    continuous = include_usage and opts.continuous_usage_stats
    offsets = [0] * (len(gen.prompts) * n)
    echoed = [False] * len(offsets)
    async for pi, ro in gen:
        for c in ro.outputs:
            k = pi * n + c.index
            text, ids, lp = c.text, c.token_ids, c.logprobs or []
            if req.echo and not echoed[k]:
                echoed[k] = True
                p = gen.prompts[pi]
                text = _prompt_text(state, p) + text
                ids = p.token_ids + ids
                lp = (ro.prompt_logprobs or [None] * len(p.token_ids)) + lp
            if not text and not ids and c.finish_reason is None:
                continue
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(state.tokenizer, ids, lp, req.logprobs, offsets[k])
            offsets[k] += len(text)
            chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                     "choices": [{"index": k, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                                  "stop_reason": c.stop_reason}]}
            if continuous:
                chunk["usage"] = gen.usage()
            yield sse(with_kv_transfer_params(chunk, gen) if c.finish_reason is not None else chunk)
    if include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "usage": gen.usage()})
    yield SSE_DONE
