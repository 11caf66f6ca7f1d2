"""Images through `tokenmill serve` (a real server on the tiny random Qwen2.5-VL): the OpenAI SDK sends an image as
a data URI and gets transformers' greedy tokens; file:// only inside --allowed-local-media-path; http(s) only to
--allowed-media-domains, never following a redirect to another host (a local HTTP server counts what it was
asked); oversize images (bytes, pixels), too many images, bad mm_processor_kwargs and an image for a text model
are clear 400s; mm_processor_kwargs' max_pixels lowers an image's tokens."""
from __future__ import annotations

import base64
import http.server
import io
import threading

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from models import tiny_model, tiny_vlm
from server_utils import API_KEY, shared_server
from test_qwen2_5_vl import IMAGES, _hf_reference, _image

MAX_BYTES = 100_000
MAX_PIXELS = 250_000


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _data_uri(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(image)).decode()


class _Images(http.server.BaseHTTPRequestHandler):
    """/img.png: an image; /elsewhere: a redirect to the same port under another host name (localhost)."""
    hits: list[str] = []
    body = b""

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).hits.append(self.path)
        if self.path == "/elsewhere":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/img.png")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    _Images.body = _png(_image(*IMAGES["small"]))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    _image(*IMAGES["small"]).save(root / "allowed" / "small.png")
    _image(*IMAGES["small"]).save(root / "outside.png")
    return root


@pytest.fixture(scope="module")
def server(request, media_dir):
    return shared_server(request.config, tiny_vlm(), "--allowed-local-media-path", str(media_dir / "allowed"),
                         "--allowed-media-domains", "127.0.0.1", "--limit-mm-per-prompt", '{"image": 2}',
                         "--max-image-bytes", str(MAX_BYTES), "--max-image-pixels", str(MAX_PIXELS),
                         "--media-fetch-timeout", "5", api_key=API_KEY)


def _chat(server, url: str, text: str = "What is this?", n_images: int = 1, **extra) -> httpx.Response:
    content = [{"type": "image_url", "image_url": {"url": url}}] * n_images + [{"type": "text", "text": text}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers, timeout=60)


def _error(resp: httpx.Response) -> str:
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]["message"]


def test_openai_sdk_sends_a_data_uri_image(server):
    import transformers

    image = _image(*IMAGES["wide"])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_uri(image)}},
                                             {"type": "text", "text": "Describe it."}]}]
    out = client.chat.completions.create(model=tiny_vlm(), messages=messages, max_tokens=8, temperature=0,
                                         logprobs=True, extra_body={"ignore_eos": True})
    tok = transformers.AutoTokenizer.from_pretrained(tiny_vlm())
    ids = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                    "text": "Describe it."}]}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    ref_tokens, ref_lps = _hf_reference(tiny_vlm(), list(ids), [image])
    # the tiny model's tokens are byte pieces: compare each greedy token's logprob with transformers'
    got = [e.logprob for e in out.choices[0].logprobs.content]
    assert got == pytest.approx([float(lp[t]) for lp, t in zip(ref_lps, ref_tokens)], abs=1e-4)
    assert out.usage.prompt_tokens == len(ids) - 1 + 24  # the placeholder became the image's 24 tokens
    stream = client.chat.completions.create(model=tiny_vlm(), messages=messages, max_tokens=8, temperature=0,
                                            logprobs=True, extra_body={"ignore_eos": True}, stream=True)
    streamed = [e.logprob for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx(got, abs=1e-4)  # (this run hits the prefix cache)


def test_responses_take_input_image_parts(server):
    """The Responses API's input_image part (its image_url a plain string) is the chat path's image: the same
    greedy text as the chat request, streamed and whole; a file_id image is a 400 (no files are kept)."""
    url = _data_uri(_image(*IMAGES["long"]))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    chat = client.chat.completions.create(
        model=tiny_vlm(), max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "What is it?"}]}])
    inp = [{"role": "user", "content": [{"type": "input_image", "image_url": url, "detail": "auto"},
                                        {"type": "input_text", "text": "What is it?"}]}]
    resp = client.responses.create(model=tiny_vlm(), input=inp, max_output_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    events = list(client.responses.create(model=tiny_vlm(), input=inp, max_output_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True}, stream=True))
    assert events[-1].type == "response.incomplete"  # cut by max_output_tokens, as the whole one is
    assert events[-1].response.output_text == resp.output_text and resp.status == "incomplete"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=tiny_vlm(), input=[{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-1"}]}], max_output_tokens=2)
    assert e.value.body["param"] == "input[0].content[0]" and "file_id" in e.value.body["message"]
    big = _data_uri(Image.fromarray(np.random.default_rng(0).integers(0, 255, (400, 400, 3), dtype=np.uint8)))
    with pytest.raises(openai.BadRequestError) as e:  # over --max-image-bytes: the chat path's 400, named input
        client.responses.create(model=tiny_vlm(), input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": big}]}], max_output_tokens=2)
    assert e.value.body["param"] == "input"


def test_local_files_only_under_the_allowed_path(server, media_dir):
    assert _chat(server, f"file://{media_dir}/allowed/small.png").status_code == 200
    assert "--allowed-local-media-path" in _error(_chat(server, f"file://{media_dir}/outside.png"))
    assert "--allowed-local-media-path" in _error(_chat(server, f"file://{media_dir}/allowed/../outside.png"))


def test_remote_images_only_from_allowed_domains(server, image_host):
    _Images.hits.clear()
    assert _chat(server, image_host + "/img.png").status_code == 200
    assert _Images.hits == ["/img.png"]
    other = image_host.replace("127.0.0.1", "localhost")
    assert "not in this server's --allowed-media-domains" in _error(_chat(server, other + "/img.png"))
    assert "redirects to another host" in _error(_chat(server, image_host + "/elsewhere"))
    assert _Images.hits == ["/img.png", "/elsewhere"]  # nothing fetched from the host it was not allowed


def test_oversize_and_too_many_images_are_400s(server):
    noisy = Image.fromarray(np.random.default_rng(3).integers(0, 256, (250, 250, 3), dtype=np.uint8))
    assert len(_png(noisy)) > MAX_BYTES
    assert "--max-image-bytes" in _error(_chat(server, _data_uri(noisy)))
    flat = Image.new("RGB", (600, 600), (10, 200, 30))  # few bytes, many pixels
    assert "--max-image-pixels" in _error(_chat(server, _data_uri(flat)))
    small = _data_uri(_image(*IMAGES["small"]))
    assert "at most 2 are allowed (--limit-mm-per-prompt)" in _error(_chat(server, small, n_images=3))
    assert "cannot be decoded" in _error(_chat(server, "data:image/png;base64," + base64.b64encode(b"nope").decode()))
    assert "unsupported mm_processor_kwargs" in _error(_chat(server, small, mm_processor_kwargs={"size": 3}))


def test_max_pixels_is_the_dial(server):
    wide = _data_uri(_image(*IMAGES["wide"]))
    full = _chat(server, wide).json()["usage"]["prompt_tokens"]
    low = _chat(server, wide, mm_processor_kwargs={"max_pixels": 28 * 28 * 6}).json()["usage"]["prompt_tokens"]
    assert full - low == 24 - 6


def test_a_text_model_refuses_images(request):
    text_server = shared_server(request.config, tiny_model("llama"), "--served-model-name", "tiny-llama",
                                api_key=API_KEY)  # test_server.py's server, shared in one session
    msg = _error(_chat(text_server, _data_uri(_image(*IMAGES["small"]))))
    assert "is not a vision-language model" in msg


def test_bench_serve_random_mm(server):
    from tokenmill.bench.serve import ServeConfig, run_benchmark

    cfg = ServeConfig(base_url=server.url, api_key=API_KEY, endpoint="chat", dataset="random-mm",
                      mm_image_size="112x84", mm_images_per_request=2, input_len=8, output_len=2, num_prompts=2,
                      progress=False)
    s = run_benchmark(cfg)["summary"]
    assert s["completed"] == 2 and s["failed"] == 0
    text_only = run_benchmark(ServeConfig(base_url=server.url, api_key=API_KEY, endpoint="chat", input_len=8,
                                          output_len=2, num_prompts=2, progress=False))["summary"]
    # per image: 12 tokens (84x112 pixels, 28x28 each) and the <|vision_start|>, <|vision_end|> around them
    assert s["total_input_tokens"] - text_only["total_input_tokens"] == 2 * 2 * (12 + 2)
    with pytest.raises(ValueError, match="use --endpoint chat"):
        run_benchmark(ServeConfig(base_url=server.url, dataset="random-mm"))
