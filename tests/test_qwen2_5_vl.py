"""Qwen2.5-VL against transformers, float32, on the tiny random model of tests/models.py (tiny_vlm: a 2-block vision
tower with window and full attention, M-RoPE with an uneven split): the image processor's pixels, one image and
two images of different sizes in a prompt (greedy tokens equal, logprobs within 1e-4), chunked prefill across
the images with each image encoded once, and the prefix cache keyed by image content."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from models import tiny_vlm
from tokenmill import LLM, SamplingParams
from tokenmill.messages import EngineCoreRequest
from tokenmill.multimodal.processor import ImageProcessor
from tokenmill.step.multimodal import patch_values

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
PROMPT = ("<|im_start|>user\nLook at <|vision_start|><|image_pad|><|vision_end|> then at "
          "<|vision_start|><|image_pad|><|vision_end|>, compare them.<|im_end|>\n<|im_start|>assistant\n")
ONE = "<|im_start|>user\nWhat is in <|vision_start|><|image_pad|><|vision_end|>?<|im_end|>\n<|im_start|>assistant\n"


def _image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


IMAGES = {"wide": (112, 168, 0), "long": (90, 200, 1), "small": (60, 60, 2)}


@pytest.fixture(scope="module")
def vlm():
    path = tiny_vlm()
    return path, ImageProcessor.from_model_dir(path, _image_token(path))


def _image_token(path: str) -> int:
    import json

    with open(f"{path}/config.json") as f:
        return json.load(f)["image_token_id"]


_HF: dict = {}


def _hf_reference(path: str, ids: list[int], images: list, max_pixels: int = 28 * 28 * 64,
                  max_tokens: int = MAX_TOKENS):
    """transformers' greedy tokens and per-step log-softmax for the prompt ids (one placeholder per image),
    with transformers' own image processor (PIL backend) making the pixels."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if "model" not in _HF:
        _HF["model"] = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    token = _image_token(path)
    proc = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_pixels)
    kwargs = {}
    expanded = list(ids)
    if images:
        batch = proc(images=images, return_tensors="pt")
        kwargs = dict(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
        counts = iter((batch["image_grid_thw"].prod(-1) // 4).tolist())
        expanded = [t for i in ids for t in ([token] * next(counts) if i == token else [i])]
    inp = torch.tensor([expanded])
    with torch.no_grad():
        g = _HF["model"].generate(inp, mm_token_type_ids=(inp == token).int(), max_new_tokens=max_tokens,
                                  do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs)
    return g.sequences[0, len(expanded):].tolist(), [lg[0].log_softmax(-1) for lg in g.logits]


def _assert_matches(out, ref) -> None:
    c = out.outputs[0]
    assert c.token_ids == ref[0]
    for step, lp in enumerate(c.logprobs):
        ids = torch.tensor(list(lp))
        torch.testing.assert_close(torch.tensor([v.logprob for v in lp.values()]), ref[1][step][ids],
                                   atol=1e-4, rtol=1e-4)


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer(text, add_special_tokens=False).input_ids


def _runner(llm: LLM):
    return llm.engine.executor.collective_rpc(lambda w: w.runner)[0]


def test_image_processor_matches_transformers(vlm):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    _, proc = vlm
    images = [_image(*IMAGES["wide"]), _image(*IMAGES["long"]), _image(*IMAGES["small"])]
    ref = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64)(images=images, return_tensors="np")
    ours = [proc.image_input(im, 0) for im in images]
    assert [list(i.grid_thw) for i in ours] == ref["image_grid_thw"].tolist()
    patches = np.concatenate([patch_values(i, proc.patch_size, proc.merge_size, proc.temporal_patch_size) for i in ours])
    np.testing.assert_array_equal(patches, ref["pixel_values"])  # bit for bit
    # the dial: fewer pixels, fewer tokens; bad options are one-line errors
    assert proc.with_options({"max_pixels": 28 * 28 * 8}).num_tokens(112, 168) <= 8 < proc.num_tokens(112, 168)
    with pytest.raises(ValueError, match="unsupported mm_processor_kwargs"):
        proc.with_options({"do_resize": False})
    with pytest.raises(ValueError, match="min_pixels .* exceeds max_pixels"):
        proc.with_options({"min_pixels": 28 * 28 * 10, "max_pixels": 28 * 28 * 4})


def test_one_and_two_images_match_transformers(vlm):
    """A batch of one-image, two-image (different sizes) and text-only prompts, each as transformers alone."""
    path, _ = vlm
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=32 << 20)
    one, two = [_image(*IMAGES["wide"])], [_image(*IMAGES["wide"]), _image(*IMAGES["long"])]
    text = "<|im_start|>user\nNo image here.<|im_end|>\n<|im_start|>assistant\n"
    prompts = [{"prompt_token_ids": _ids(llm, ONE), "multi_modal_data": {"image": one}},
               {"prompt_token_ids": _ids(llm, PROMPT), "multi_modal_data": {"image": two}},
               {"prompt_token_ids": _ids(llm, text)}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(outs[1].prompt_token_ids) == len(_ids(llm, PROMPT)) - 2 + 24 + 21  # placeholders widened
    for out, (ids, images) in zip(outs, [(ONE, one), (PROMPT, two), (text, [])]):
        _assert_matches(out, _hf_reference(path, _ids(llm, ids), images))
    assert _runner(llm).mm.num_encoded == 3
    # the images matter: the same ids with the images swapped give another distribution
    swapped = llm.generate([{"prompt_token_ids": _ids(llm, PROMPT), "multi_modal_data": {"image": two[::-1]}}],
                           GREEDY, use_tqdm=False)
    assert swapped[0].outputs[0].logprobs[0] != outs[1].outputs[0].logprobs[0]
    assert llm.engine.scheduler.kv.is_whole()


def test_chunked_prefill_across_images_encodes_each_once(vlm):
    """8-token steps cut both images into several chunks; each image still runs the vision tower once."""
    path, _ = vlm
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=8, block_size=16)
    two = [_image(*IMAGES["wide"]), _image(*IMAGES["long"])]
    out = llm.generate([{"prompt_token_ids": _ids(llm, PROMPT), "multi_modal_data": {"image": two}}], GREEDY,
                       use_tqdm=False)
    _assert_matches(out[0], _hf_reference(path, _ids(llm, PROMPT), two))
    assert _runner(llm).mm.num_encoded == 2
    assert not _runner(llm).mm.features  # each image's tokens dropped once its last chunk ran
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)  # its step drops the finished one
    assert out[0].request_id not in _runner(llm).mm.positions


def test_prefix_cache_hits_only_the_same_image(vlm):
    path, _ = vlm
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=32 << 20, block_size=16)
    ids = _ids(llm, ONE)
    first_image, other_image = _image(*IMAGES["wide"]), _image(112, 168, 7)  # same size: same token ids
    ref = _hf_reference(path, ids, [first_image])
    runs = [llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": [im]}}], GREEDY,
                         use_tqdm=False)[0] for im in (first_image, first_image, other_image)]
    assert runs[0].prompt_token_ids == runs[2].prompt_token_ids
    assert runs[0].num_cached_tokens == 0
    assert runs[1].num_cached_tokens == (len(runs[1].prompt_token_ids) - 1) // 16 * 16  # every full block
    offset = ids.index(_image_token(path))
    assert runs[2].num_cached_tokens == offset // 16 * 16  # only the blocks before the image
    _assert_matches(runs[0], ref)
    _assert_matches(runs[1], ref)
    _assert_matches(runs[2], _hf_reference(path, ids, [other_image]))
    assert _runner(llm).mm.num_encoded == 2  # the hit needed no encoding


def test_bad_image_requests_are_clear_errors(vlm, tiny):
    path, _ = vlm
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=32 << 20, limit_mm_per_prompt='{"image": 1}')
    two = [_image(*IMAGES["small"]), _image(*IMAGES["small"])]
    with pytest.raises(ValueError, match=r"at most 1 are allowed \(--limit-mm-per-prompt\)"):
        llm.generate([{"prompt_token_ids": _ids(llm, PROMPT), "multi_modal_data": {"image": two}}], GREEDY)
    with pytest.raises(ValueError, match="1 image placeholder tokens but 0 images"):
        llm.generate([{"prompt_token_ids": _ids(llm, ONE), "multi_modal_data": {"image": []}}], GREEDY)
    with pytest.raises(ValueError, match="placeholder tokens but no image"):  # the engine checks too
        llm.engine.add_request(EngineCoreRequest("raw", _ids(llm, ONE), GREEDY))
    with pytest.raises(ValueError, match="limit-mm-per-prompt takes a JSON object"):
        LLM(path, limit_mm_per_prompt='{"video": 1}')
    text_model = LLM(tiny("qwen2"), dtype="float32", kv_cache_memory_bytes=16 << 20)
    with pytest.raises(ValueError, match="is not a vision-language model"):
        text_model.generate([{"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": two[:1]}}], GREEDY)


def test_speculation_with_images(vlm):
    """N-gram speculation on image prompts gives the tokens greedy decoding gives; a draft model or an EAGLE head,
    which would not see the images, is refused at start-up."""
    path, _ = vlm
    two = [_image(*IMAGES["wide"]), _image(*IMAGES["long"])]
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=16 << 20)
    prompts = [{"prompt_token_ids": _ids(llm, PROMPT), "multi_modal_data": {"image": two}}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = llm.generate(prompts, params, use_tqdm=False)
    spec = LLM(path, dtype="float32", kv_cache_memory_bytes=16 << 20, speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}))
    out = spec.generate(prompts, params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert spec.engine.scheduler.kv.is_whole()
    for method in ("draft_model", "eagle"):
        with pytest.raises(ValueError, match=f"a {method} drafter is not supported with a vision-language model"):
            LLM(path, speculative_config=json.dumps({"method": method, "model": path, "num_speculative_tokens": 2}))


def test_decoder_stack_steps_aside_with_a_reason(vlm):
    path, _ = vlm
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=16 << 20)
    assert llm.engine.executor.kernels()["decoder_stack"].startswith("off: Qwen2.5-VL's M-RoPE")


def test_preemption_recomputes_images_exactly(vlm):
    """Three two-image prompts (~76 tokens each) in a cache of 14 blocks of 16 tokens: some are preempted and
    recomputed (their images encoded again) and still match transformers."""
    path, _ = vlm
    llm = LLM(path, dtype="float32", num_gpu_blocks_override=14, block_size=16, max_num_batched_tokens=32)
    sets = [[_image(*IMAGES["wide"]), _image(*IMAGES["long"])], [_image(*IMAGES["long"]), _image(*IMAGES["wide"])],
            [_image(112, 168, 11), _image(90, 200, 12)]]
    prompts = [{"prompt_token_ids": _ids(llm, PROMPT), "multi_modal_data": {"image": s}} for s in sets]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5),
                        use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert llm.engine.scheduler.kv.is_whole()
    for out, images in zip(outs, sets):
        ref = _hf_reference(path, _ids(llm, PROMPT), images, max_tokens=24)
        _assert_matches(out, ref)


def test_images_share_an_encoder_budget_per_step(vlm):
    """A 32-token step budget is also the step's encoder budget. Prompts of an image (24 tokens) then two tokens:
    the first prompt's 27 tokens leave 5, enough to reach the second's image, but encoding it would make 48
    image tokens in one step; that chunk stops before the image instead. Tokens still match transformers."""
    path, proc = vlm
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=32)
    sets = [[_image(*IMAGES["wide"])], [_image(112, 168, 5)], [_image(84, 112, 6)]]
    ids = _ids(llm, "<|vision_start|><|image_pad|><|vision_end|>hi")
    encoded, steps = _runner(llm).mm, []
    for i, images in enumerate(sets):
        expanded, mm = proc.expand_prompt(ids, images)
        llm.engine.add_request(EngineCoreRequest(f"r{i}", expanded, GREEDY, mm_inputs=mm))
    while llm.engine.has_unfinished_requests():
        before = encoded.encoded_tokens
        llm.engine.step()
        steps.append(encoded.encoded_tokens - before)
    assert encoded.num_encoded == 3 and sum(steps) == 24 + 24 + 12
    assert max(steps) <= 32, steps
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": s}} for s in sets], GREEDY,
                        use_tqdm=False)
    for out, images in zip(outs, sets):
        _assert_matches(out, _hf_reference(path, ids, images))


def test_llm_chat_takes_image_parts(vlm, tmp_path):
    """LLM.chat: image_url parts as data: URIs and file:// paths give the tokens generate gives for the
    rendered prompt and the images; remote URLs are refused offline."""
    import base64
    import io

    path, _ = vlm
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=32 << 20)
    wide, long = _image(*IMAGES["wide"]), _image(*IMAGES["long"])
    buf = io.BytesIO()
    wide.save(buf, format="PNG")
    long.save(tmp_path / "long.png")
    data_uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": data_uri}}, {"type": "text", "text": "and"},
               {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/long.png"}}]
    out = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)[0]
    text = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and<|vision_start|><|image_pad|>"
            "<|vision_end|><|im_end|>\n<|im_start|>assistant\n")
    _assert_matches(out, _hf_reference(path, _ids(llm, text), [wide, long]))
    with pytest.raises(ValueError, match="remote image URLs are not allowed"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x.test/a.png"}}]}])


def test_prefix_hit_ending_inside_an_image(vlm):
    """A prompt ending with its image: the second run's hit (16 tokens) ends inside the image, so the rest of the
    image's tokens are this run's rows of a fresh encoding."""
    path, _ = vlm
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=32 << 20, block_size=16)
    ids = _ids(llm, "<|vision_start|><|image_pad|><|vision_end|>hi")
    image = _image(*IMAGES["wide"])
    runs = [llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}}], GREEDY,
                         use_tqdm=False)[0] for _ in range(2)]
    assert runs[1].num_cached_tokens == 16 and 1 < 16 < 1 + 24  # inside the image's tokens [1, 25)
    ref = _hf_reference(path, ids, [image])
    _assert_matches(runs[0], ref)
    _assert_matches(runs[1], ref)
    assert _runner(llm).mm.num_encoded == 2


@pytest.mark.distributed
def test_tensor_parallel_matches_transformers(vlm):
    """TP=2 (mp executor: the images travel to both ranks in the step message; each rank runs the replicated
    vision tower and its half of the decoder's heads, q/k/v biases included) gives transformers' tokens."""
    path, _ = vlm
    llm = LLM(path, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16,
              kv_cache_memory_bytes=32 << 20)
    try:
        two = [_image(*IMAGES["wide"]), _image(*IMAGES["long"])]
        out = llm.generate([{"prompt_token_ids": _ids(llm, PROMPT), "multi_modal_data": {"image": two}}], GREEDY,
                           use_tqdm=False)
        _assert_matches(out[0], _hf_reference(path, _ids(llm, PROMPT), two))
    finally:
        llm.engine.shutdown()
