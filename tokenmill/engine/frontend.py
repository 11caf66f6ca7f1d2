"""What both fronts (offline LLM, API server) do before a request reaches the engine: tokenize,
validate, and fan an n>1 request out into one engine request per sample."""
from __future__ import annotations

import json
import logging
import os
from typing import Optional, Union

from tokenmill.config import EngineConfig
from tokenmill.host import release_free_heap
from tokenmill.lora import LoRARequest
from tokenmill.messages import EngineCoreRequest
from tokenmill.models import resolution_cache
from tokenmill.multimodal.processor import ImageProcessor
from tokenmill.step.multimodal import ImageInput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")

PromptType = Union[str, dict, list[int]]


def load_tokenizer(config: EngineConfig):
    """The model's tokenizer: the class the last start's record names (no AutoConfig, so no torch), else
    AutoTokenizer's choice, which then completes the record (models/resolution_cache.py)."""
    mc = config.model
    tokenizer = None
    if not mc.skip_tokenizer_init:
        try:
            if mc.tokenizer_class is not None:
                tokenizer = resolution_cache.load_tokenizer_class(mc.tokenizer_class, mc.tokenizer)
            else:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"cannot load a tokenizer from {mc.tokenizer}: {str(e).splitlines()[0]}") from None
    if mc.resolution_key is not None and tokenizer is not None:
        resolution_cache.save(mc.resolution_key, mc.hf_config, mc.dtype_name, tokenizer)
    release_free_heap()  # transformers parses the tokenizer's JSON in Python on the way
    return tokenizer


def eos_token_ids(config: EngineConfig, tokenizer) -> list[int]:
    """The ids that end a generation (unless ignore_eos), as vLLM reads them: the tokenizer's eos, then the
    model's own from config.json and generation_config.json's list (Gemma 3 instruct ends its turns with
    <end_of_turn> beside <eos>; a GGUF's end-of-generation tokens: models/gguf.py)."""
    found = [tokenizer.eos_token_id] if tokenizer is not None else []
    for ids in (getattr(config.model.hf_config, "eos_token_id", None), _generation_eos(config.model.model_dir)):
        found += ids if isinstance(ids, list) else [ids]
    return list(dict.fromkeys(i for i in found if isinstance(i, int)))


def _generation_eos(model_dir: str) -> Optional[Union[int, list[int]]]:
    try:
        with open(os.path.join(model_dir, "generation_config.json")) as f:
            return json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):  # none, unreadable, or not an object
        return None


def load_image_processor(config: EngineConfig) -> Optional[ImageProcessor]:
    """A vision-language model's image processor with the server's --mm-processor-kwargs; None for others."""
    hf = config.model.hf_config
    if getattr(hf, "vision_config", None) is None or getattr(hf, "image_token_id", None) is None:
        return None
    return ImageProcessor.from_model_dir(config.model.model_dir, hf.image_token_id).with_options(
        config.model.mm_processor_kwargs)


def prepare_images(ids: list[int], images: list, processor: Optional[ImageProcessor], config: EngineConfig,
                   options: Optional[dict] = None) -> tuple[list[int], list[ImageInput]]:
    """The prompt with its image placeholders widened and its images preprocessed (PIL images, in prompt
    order; options: the request's mm_processor_kwargs). ValueError, a 400, for images a model cannot take."""
    if not images and (processor is None or processor.image_token_id not in ids):
        return ids, []
    if processor is None:
        raise ValueError(f"{config.model.served_model_name} is not a vision-language model; it takes no images")
    limit = config.model.max_images_per_prompt
    if len(images) > limit:
        raise ValueError(f"{len(images)} images in one prompt; at most {limit} are allowed (--limit-mm-per-prompt)")
    return processor.with_options(options).expand_prompt(ids, images)


def tokenize_prompt(prompt: PromptType, tokenizer) -> tuple[Optional[str], list[int]]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        prompt = prompt["prompt"]
    if isinstance(prompt, list):
        return None, list(prompt)
    if tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer; pass {'prompt_token_ids': [...]} "
                         "or do not set skip_tokenizer_init")
    return prompt, tokenizer(prompt).input_ids


def fan_out(request_id: str, prompt_ids: list[int], params: SamplingParams, eos_ids: list[int],
            enable_prefix_caching: bool, cache_salt: Optional[str] = None,
            arrival_time: float = 0.0, kv_transfer_params: Optional[dict] = None,
            priority: int = 0, lora_request: Optional[LoRARequest] = None,
            mm_inputs: Optional[list[ImageInput]] = None) -> list[EngineCoreRequest]:
    """One engine request per sample. Siblings share the prompt's KV blocks through the prefix cache
    (with caching off, through a salt only they carry); seeded siblings get seed + index, as in vLLM.
    kv_transfer_params (disaggregated prefill/decode) goes to every one of them, less a prefill instance's
    first_token_id: one sampled token cannot start n different samples (each samples its first token itself).
    lora_request: the adapter every sample runs (None: the base model)."""
    if params.n == 1:
        return [EngineCoreRequest(request_id, prompt_ids, params, eos_ids, arrival_time,
                                  cache_salt if enable_prefix_caching else None, kv_transfer_params, priority,
                                  lora_request, mm_inputs or [])]
    if kv_transfer_params is not None:
        kv_transfer_params = {k: v for k, v in kv_transfer_params.items() if k != "first_token_id"}
    salt = cache_salt if enable_prefix_caching else f"\0n:{request_id}"
    reqs = []
    for i in range(params.n):
        # seed + i, wrapped to stay a signed 64-bit integer
        seed = None if params.seed is None else (params.seed + i + 2**63) % 2**64 - 2**63
        child = params.clone(n=1, seed=seed)
        reqs.append(EngineCoreRequest(f"{i}-{request_id}", prompt_ids, child, eos_ids, arrival_time, salt,
                                      kv_transfer_params, priority, lora_request, mm_inputs or []))
    return reqs
