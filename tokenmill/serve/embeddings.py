"""/v1/embeddings (OpenAI shape) on a server running --task embed.

Each input becomes one engine request (tokenmill/engine/pooling.py: truncate_prompt_tokens, `dimensions`);
the engine batches them with everyone else's into flat steps and finishes each with its pooled vector. The
response carries the vectors as JSON floats or, with encoding_format=base64, as base64 of little-endian float32
(what OpenAI sends and its SDK decodes).
"""
from __future__ import annotations

import base64
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from tokenmill.engine.pooling import check_dimensions, embed_params, embed_token_ids, final_vector
from tokenmill.http.disconnect import until_disconnected
from tokenmill.http.errors import bad_request
from tokenmill.serve.protocol import EmbeddingRequest
from tokenmill.serve.serving import Generation, Prompt, check_text_length, json_response, off_loop, random_id

if TYPE_CHECKING:
    from tokenmill.serve.api_server import ServerState

MAX_INPUTS = 2048  # OpenAI's bound on inputs per request


async def _prompts(state: "ServerState", req: EmbeddingRequest) -> list[Prompt]:
    inputs = req.inputs()
    if len(inputs) > MAX_INPUTS:
        raise bad_request(f"input has {len(inputs)} entries; at most {MAX_INPUTS} per request", "input")
    mc = state.config.model
    prompts = []
    for i, x in enumerate(inputs):
        where = "input" if len(inputs) == 1 else f"input[{i}]"
        if isinstance(x, str):
            check_text_length(state, x, "input")
        try:
            ids = await off_loop(embed_token_ids, state.tokenizer, x, req.truncate_prompt_tokens, mc.max_model_len)
            state.engine.validate(ids, embed_params())
        except ValueError as e:
            param = "truncate_prompt_tokens" if "truncate_prompt_tokens must" in str(e) else "input"
            raise bad_request(f"{where}: {e}", param) from None
        prompts.append(Prompt(x if isinstance(x, str) else None, ids))
    return prompts


async def create_embedding(state: "ServerState", req: EmbeddingRequest, raw: Request) -> Response:
    state.check_model(req.model)
    pooler = state.config.model.pooler
    try:
        check_dimensions(pooler, req.dimensions, state.config.model.hf_config.hidden_size, state.model_name)
    except ValueError as e:
        raise bad_request(str(e), "dimensions") from None
    prompts = await _prompts(state, req)
    gen = Generation(state, random_id("embd"), prompts, embed_params())
    try:
        vectors = await until_disconnected(raw, _collect(gen, len(prompts)))
    finally:
        gen.close()
    if vectors is None:
        return Response(status_code=499)
    data = []
    for i, pooled in enumerate(vectors):
        vec = final_vector(pooled, pooler, req.dimensions)
        emb = base64.b64encode(vec.tobytes()).decode() if req.encoding_format == "base64" else vec.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = sum(len(p.token_ids) for p in prompts)
    return json_response({"object": "list", "data": data, "model": state.model_name,
                          "usage": {"prompt_tokens": n, "total_tokens": n}})


async def _collect(gen: Generation, n: int) -> list[bytes]:
    vectors: list = [None] * n
    async for i, ro in gen:
        if ro.finished:
            vectors[i] = ro.embedding
    return vectors
