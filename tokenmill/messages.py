"""What crosses the API <-> engine socket (the requests, their outputs, the engine's stats) and the engine's
record of a request. A leaf of the contracts layer: the API process imports it without the engine (or torch),
the engine core and its connectors' scheduler halves share the Request record."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import msgspec

from tokenmill.lora import LoRARequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.step.multimodal import ImageInput


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    REJECTED = 3  # the request's own data failed in the engine (a grammar that does not compile): a 400
    ERROR = 4     # running the request failed in the engine (the engine itself keeps serving): a 500

    def __str__(self) -> str:
        return ("stop", "length", "abort", "rejected", "error")[self.value]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """What a front (LLM or API server) submits to the engine core."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # The ids that end a generation unless ignore_eos: the tokenizer's eos and the model's other end tokens
    # (generation_config.json's eos_token_id list, e.g. Gemma's <end_of_turn>; frontend.eos_token_ids)
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    arrival_time: float = 0.0
    # Requests with the same cache_salt may share prefix-cache blocks; others never do.
    cache_salt: Optional[str] = None
    # Disaggregated prefill/decode (vLLM's kv_transfer_params): {"do_remote_decode": true} to a prefill
    # instance; to a decode instance, the params the prefill instance returned (where to pull the KV from).
    kv_transfer_params: Optional[dict[str, Any]] = None
    # --scheduling-policy priority: lower runs first (ties by arrival); must be 0 under fcfs
    priority: int = 0
    lora_request: Optional[LoRARequest] = None  # the adapter it runs (--enable-lora); None: the base model
    # Images in the prompt, by position (a VLM's; step/multimodal.py), as the front preprocessed them
    mm_inputs: list[ImageInput] = msgspec.field(default_factory=list)


def check_token_ids(prompt_token_ids: list[int], sp: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError naming the first token id (prompt, logit_bias, stop_token_ids) outside the
    vocabulary: each would index past the logits somewhere in the step."""
    for what, ids in (("token id", prompt_token_ids), ("logit_bias token id", sp.logit_bias or ()),
                      ("stop_token_ids entry", sp.stop_token_ids)):
        bad = next((t for t in ids if not 0 <= int(t) < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{what} {bad} is out of range for the vocabulary of {vocab_size}")


def check_priority(priority: int, policy: str) -> None:
    """A priority means something only under the priority policy (as vLLM, refused rather than ignored)."""
    if priority and policy != "priority":
        raise ValueError(f"priority {priority} needs --scheduling-policy priority (this engine schedules {policy})")


def check_fits(prompt_len: int, sp: SamplingParams, max_model_len: int, block_size: int, num_blocks: int,
               pooling: bool = False, blocks_for: Optional[Callable[[int], int]] = None) -> None:
    """Reject at once what could never run, rather than letting it wait forever (the scheduler on admission,
    and the API process before anything streams). pooling (--task embed): the prompt is all a request runs,
    and it may fill the whole context. blocks_for(tokens): the most blocks a request of that many tokens holds at
    once (KV groups: step/kv_groups.py; default one block per block_size tokens)."""
    blocks_for = blocks_for or (lambda n: -(-n // block_size))
    if prompt_len == 0:
        raise ValueError("the prompt is empty; it must contain at least one token")
    if pooling:
        if prompt_len > max_model_len:
            raise ValueError(f"the input has {prompt_len} tokens, but the model's maximum is {max_model_len}; "
                             "shorten it or set truncate_prompt_tokens")
        if blocks_for(prompt_len) > num_blocks:
            raise ValueError(f"the input needs {prompt_len} tokens of KV cache ({blocks_for(prompt_len)} blocks) but "
                             f"the whole cache holds {num_blocks} blocks of {block_size} tokens; "
                             "raise --kv-cache-memory-bytes")
        return
    if prompt_len >= max_model_len:
        raise ValueError(f"the prompt has {prompt_len} tokens, but the model's context length is "
                         f"{max_model_len}; nothing is left to generate")
    if sp.max_tokens is not None and prompt_len + sp.max_tokens > max_model_len:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({sp.max_tokens}) = "
                         f"{prompt_len + sp.max_tokens} exceeds the context length {max_model_len}")
    max_total = prompt_len + (sp.max_tokens if sp.max_tokens is not None else max_model_len - prompt_len)
    blocks = blocks_for(max_total)
    if blocks > num_blocks:
        raise ValueError(f"the request needs up to {max_total} tokens of KV cache ({blocks} blocks) but the "
                         f"whole cache holds {num_blocks} blocks of {block_size} tokens; "
                         "raise --kv-cache-memory-bytes or lower max_tokens")


from tokenmill.step import PositionLogprobs  # noqa: E402 - (token ids, logprobs, rank of the first id)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the engine core reports per request per step."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[list[PositionLogprobs]] = None
    new_prompt_logprobs: Optional[list[PositionLogprobs]] = None
    finish_reason: Optional[int] = None
    stop_reason: Optional[int] = None  # the stop token id that ended it
    num_cached_tokens: int = 0
    error: Optional[str] = None  # why, with finish_reason REJECTED or ERROR
    kv_transfer_params: Optional[dict[str, Any]] = None  # a prefill instance's finished request: where its KV is
    pooled: Optional[bytes] = None  # --task embed: the finished request's embedding (float32 little-endian)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


class Request:
    """Scheduler-side state. Tokens [0, num_computed_tokens) have KV in the request's blocks."""

    def __init__(self, req: EngineCoreRequest, max_model_len: int) -> None:
        self.request_id = req.request_id
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.sampling_params = req.sampling_params
        self.eos_token_ids = req.eos_token_ids
        self.cache_salt = req.cache_salt
        self.kv_transfer_params = req.kv_transfer_params  # disaggregated prefill/decode (kv_transfer/p2p_*)
        self.lora_request = req.lora_request
        self.mm_inputs = req.mm_inputs  # images in the prompt (step/multimodal.py)
        self.arrival_time = req.arrival_time or time.time()
        self.priority = req.priority
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 = not scheduled yet
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[FinishReason] = None
        self.stop_reason: Optional[int] = None
        self.block_hashes: list[bytes] = []  # hash chain over full blocks of all_token_ids
        self.num_preemptions = 0
        self.num_prompt_logprobs_done = 0  # prompt positions whose logprobs were reported
        # The worker's copy (tokenmill/step/): block ids (per KV group: as many in each) and output tokens sent
        # to it since admission
        self.num_blocks_sent = 0
        self.num_outputs_sent = 0
        sp = self.sampling_params
        max_tokens = sp.max_tokens if sp.max_tokens is not None else max_model_len - self.num_prompt_tokens
        self.max_tokens = min(max_tokens, max_model_len - self.num_prompt_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Token-id stops and length; stop strings are the front's job (they need text)."""
        sp = self.sampling_params
        n_out = self.num_output_tokens
        last = self.all_token_ids[-1]
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                self.finish_reason, self.stop_reason = FinishReason.STOP, None
                return True
            if last in sp.stop_token_ids:
                self.finish_reason, self.stop_reason = FinishReason.STOP, last
                return True
        if n_out >= self.max_tokens:
            self.finish_reason = FinishReason.LENGTH
            return True
        return False


# EngineStats: the counters the engine core sends the API process with each step's outputs (queues, KV blocks,
# prefix cache, speculation, connectors, per-step records).
@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_blocks: int
    # Prompt tokens past the device hit looked up in / supplied by lower KV tiers (vLLM's external_prefix_cache_*)
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # Prompt tokens the model actually ran (cumulative): not prefix-cache hits, not tokens a KV connector
    # supplied (a decode instance's transferred prompts count 0), again after a preemption
    prompt_tokens_computed: int = 0
    num_interrupted_steps: int = 0  # steps cut short for a better-ranked arrival (step/interrupt.py), cumulative
    # Speculative decoding (cumulative; zero without it)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    spec_k: int = 0                 # drafts per request in the last step (the controller's choice)
    # MoE: tokens routed to each expert, [MoE layer][expert] (cumulative; empty for a dense model)
    expert_load: list[list[int]] = field(default_factory=list)
    # KV connectors' counters (cumulative): tiers (saved_blocks, host_hit_blocks, ...) and disaggregated
    # transfer (kv_pulls, kv_pull_fallbacks, kv_bytes_received/_sent, kv_held_requests, ...)
    kv_connector: dict[str, int] = field(default_factory=dict)
    # Steps since the last stats (engine/step_records.py STEP_FIELDS); empty unless config.step_records
    steps: list[list[float]] = field(default_factory=list)
    num_cached_free_blocks: int = 0  # free blocks still holding a cached prefix (refreshed a few times a second)
