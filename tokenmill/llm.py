"""Offline API, vLLM-shaped: LLM(model=...).generate(prompts, sampling_params), .chat(messages), .embed(inputs)."""
from __future__ import annotations

import itertools
import logging
from typing import Any, Optional, Sequence, Union

from tokenmill.chat_template import render_chat_template
from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.frontend import (PromptType, eos_token_ids, fan_out, load_image_processor, load_tokenizer,
                                      prepare_images, tokenize_prompt)
from tokenmill.engine.output_processor import OutputProcessor, RequestState
from tokenmill.engine.pooling import EmbedInput, check_dimensions, embed_params, embed_token_ids, final_vector
from tokenmill.lora import LoRARequest, read_adapter_config
from tokenmill.models.resolution import resolve_engine_config
from tokenmill.multimodal.chat import template_content
from tokenmill.multimodal.media import MediaPolicy, load_image
from tokenmill.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")

# LLM.chat's images: the caller's own files and data: URIs; no remote URL (nothing is downloaded at run time)
OFFLINE_MEDIA = MediaPolicy(allowed_local_media_path="/")


def _with_image_parts(conversation: list[dict]) -> tuple[list[dict], list[str]]:
    """The conversation as the template sees it (multimodal/chat.py) and its image URLs in order."""
    out, urls = [], []
    for message in conversation:
        content, found = template_content(message.get("content")) if isinstance(message, dict) else (None, [])
        out.append({**message, "content": content} if found else message)
        urls += found
    return out, urls


class LLM:
    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        self.config = resolve_engine_config(EngineConfig.from_kwargs(model=model, **kwargs))
        # the tokenizer first: its load's transient Python heap is handed back before the weights arrive, so
        # it does not add to the start's peak RSS
        self.tokenizer = load_tokenizer(self.config)
        self.engine = EngineCore(self.config)
        self.eos_token_ids = eos_token_ids(self.config, self.tokenizer)
        self.image_processor = load_image_processor(self.config)  # None unless a vision-language model
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._adapters: set[int] = set()  # lora_int_ids whose adapter config was checked

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True,
                 lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
                 priority: Optional[Sequence[int]] = None) -> list[RequestOutput]:
        """lora_request: the adapter all prompts run, or one per prompt (None: the base model); needs
        enable_lora=True. priority: one per prompt, with scheduling_policy='priority' (lower first; vLLM's)."""
        if self.config.model.pooler is not None:
            raise ValueError(f"{self.config.model.served_model_name} runs with --task embed: it does not generate "
                             "text; use LLM.embed")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        for lr in set(loras) - {None}:
            self._check_adapter(lr)
        return self._run_all(prompts, params, use_tqdm, loras, priority)

    def _check_adapter(self, lr: LoRARequest) -> None:
        """What the server checks before an adapter is used: LoRA on, the folder a PEFT adapter within limits."""
        if self.config.lora is None:
            raise ValueError("lora_request needs LLM(..., enable_lora=True)")
        if lr.lora_int_id not in self._adapters:
            read_adapter_config(lr.lora_path, self.config.lora.max_lora_rank)
            self._adapters.add(lr.lora_int_id)

    def _run_all(self, prompts: Sequence[PromptType], params: Sequence[SamplingParams], use_tqdm: bool,
                 loras: Optional[Sequence[Optional[LoRARequest]]] = None,
                 priority: Optional[Sequence[int]] = None) -> list[RequestOutput]:
        order: dict[str, int] = {}
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                rid = str(next(self._ids))
                self._add(rid, prompt, sp, loras[i] if loras else None, priority[i] if priority is not None else 0)
                order[rid] = i
            return self._run(order, use_tqdm)
        except BaseException:
            for rid in order:  # a failure (or Ctrl-C) must not leave requests holding KV blocks
                self.engine.abort_requests(self.processor.abort(rid)[1])
            while self.engine.scheduler.requests or self.engine.scheduler.pending:  # not blocks held for
                self.engine.step()                                                 # a KV transfer
            raise

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: Optional[str] = None, continue_final_message: bool = False,
             tools: Optional[list] = None, lora_request: Union[LoRARequest, Sequence[LoRARequest], None] = None,
             **template_kwargs: Any) -> list[RequestOutput]:
        """Generate for one conversation or a list of them, each rendered with the chat template
        (tokenmill.chat_template; `template_kwargs` become template variables); lora_request as in generate. A
        vision-language model's messages may hold image_url parts: data: URIs and file:// paths (nothing is
        downloaded)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init is set)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            conv, urls = _with_image_parts(conv)
            text = render_chat_template(self.tokenizer, conv, chat_template=chat_template,
                                        add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, tools=tools,
                                        template_kwargs=template_kwargs)
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": ids,
                            "multi_modal_data": {"image": [load_image(url, OFFLINE_MEDIA) for url in urls]}})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def embed(self, prompts: Union[EmbedInput, Sequence[EmbedInput]], truncate_prompt_tokens: Optional[int] = None,
              dimensions: Optional[int] = None, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One pooled vector per input (a text or a list of token ids), in order; needs --task embed (the
        default for an encoder or a sentence-transformers folder). truncate_prompt_tokens and dimensions as in
        /v1/embeddings (tokenmill/engine/pooling.py)."""
        pooler = self.config.model.pooler
        if pooler is None:
            raise ValueError(f"{self.config.model.served_model_name} runs with --task generate; "
                             "pass task='embed' to LLM(...) to embed with it")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        check_dimensions(pooler, dimensions, self.config.model.hf_config.hidden_size,
                         self.config.model.served_model_name)
        ids = [embed_token_ids(self.tokenizer, p, truncate_prompt_tokens, self.config.model.max_model_len)
               for p in prompts]
        outs = self._run_all([{"prompt_token_ids": i} for i in ids], [embed_params()] * len(ids), use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids,
                                       EmbeddingOutput(final_vector(o.embedding, pooler, dimensions).tolist()))
                for o in outs]

    # -- internals --------------------------------------------------------------------------
    def _add(self, rid: str, prompt: PromptType, sp: SamplingParams, lora: Optional[LoRARequest],
             priority: int = 0) -> None:
        text, ids = tokenize_prompt(prompt, self.tokenizer)
        extra = prompt if isinstance(prompt, dict) else {}  # as vLLM's prompt dicts
        images = (extra.get("multi_modal_data") or {}).get("image") or []  # PIL images, one per placeholder
        ids, mm = prepare_images(ids, images if isinstance(images, list) else [images], self.image_processor,
                                 self.config, extra.get("mm_processor_kwargs"))
        reqs = fan_out(rid, ids, sp, self.eos_token_ids, self.config.cache.enable_prefix_caching,
                       extra.get("cache_salt"), kv_transfer_params=extra.get("kv_transfer_params"),
                       priority=priority, lora_request=lora, mm_inputs=mm)
        for r in reqs:
            self.engine.add_request(r)  # validates; raises before anything runs for a bad request
        self.processor.add_request(RequestState(rid, text, ids, sp, self.tokenizer, delta=False),
                                   [r.request_id for r in reqs])

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[Optional[RequestOutput]] = [None] * len(order)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(order), desc="Processed prompts", dynamic_ncols=True)
        remaining = len(order)
        while remaining:
            outputs = self.engine.step()
            finished, to_abort = self.processor.process(outputs)
            if to_abort:
                self.engine.abort_requests(to_abort)
            for _, ro in finished:
                results[order[ro.request_id]] = ro
                remaining -= 1
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        # Flush aborts (stop strings) so their blocks return to the pool now.
        # (Blocks a KV connector holds for another instance are given back by later steps, not waited for.)
        while self.engine.scheduler.pending and not self.engine.scheduler.requests:
            self.engine.step()
        return results
