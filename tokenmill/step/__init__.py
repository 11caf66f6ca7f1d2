"""The per-step contract between the engine core and the workers: what runs this step (SchedulerOutput) and
what came back (ModelRunnerOutput). Both sides import this module and nothing of each other's. Messages are
msgspec Structs, so a multi-process executor encodes a step once (msgpack) and sends the same bytes to
every rank.

Deltas, not whole lists. A request's unchanging data (prompt, sampling parameters, EOS ids) travels once, in
a NewRequest, on its first step after it is (re)admitted; each later step carries only what changed since
the request's previous step: blocks appended to its block tables (one per KV group) and tokens the engine
appended to its output. Invariant: a worker's copy of a request (worker/request_states.py) equals its
NewRequest plus the deltas of every step since, in order; the copy is dropped when the id is in
finished_req_ids, and replaced when the request is sent as new again (preemption and failure roll-back free its
blocks and re-admit it). Every rank therefore receives every step, including steps that schedule nothing but
finish requests. Blocks a sliding-window KV group gives back are not announced: the worker's copy keeps their
stale ids, which attention never reads (engine/kv_cache_manager.py says why that is safe).

Per-request step state that decides what the engine emits stays in the engine core: grammar matchers
advance in the scheduler's update and their bitmask is shipped here; stop checks and max_tokens are the
scheduler's. The worker keeps only what it needs to run the model and sample (seeded generators, drafter
histories).
"""
from __future__ import annotations

from typing import Optional

import msgspec

from tokenmill.lora import LoRARequest
from tokenmill.step.multimodal import ImageInput
from tokenmill.step.offload_plan import OffloadOutput, OffloadPlan
from tokenmill.step.p2p_plan import TransferOutput, TransferPlan
from tokenmill.sampling_params import SamplingParams

# (token ids, logprobs, rank of the first id): the sampled/prompt token first, then the top-n alternatives
PositionLogprobs = tuple[list[int], list[float], int]


class NewRequest(msgspec.Struct, array_like=True):
    """Sent once per admission: what the worker keeps about a request for as long as it runs."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    output_token_ids: list[int]   # its output so far: a re-admitted request's, or a prefill instance's first token
    lora_request: Optional[LoRARequest] = None  # its adapter (the worker loads it by path, once); None: base
    mm_inputs: list[ImageInput] = msgspec.field(default_factory=list)  # images in the prompt, for the encoder


class ScheduledRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's work in one step, as a delta on the worker's copy of it."""
    request_id: str
    token_ids: list[int]          # the tokens to run this step: known tokens, then num_spec drafts
    start_pos: int                # = num_computed_tokens before this step
    # Per KV group (step/kv_groups.py), the blocks appended to its block table since the request's previous step
    # (all, if new): as many in every group, [] when none. Blocks a sliding group gave back are not announced.
    new_block_ids: list[list[int]]
    new_output_token_ids: list[int]  # appended to the output since the previous step (accepted tokens)
    sample: bool                  # this chunk reaches the end of the known tokens: sample the next one
    prompt_logprobs_from: int = 0  # prompt positions before this were already reported (preemption)
    # Speculative decoding
    num_spec: int = 0              # the last num_spec of token_ids are draft tokens to verify
    num_propose: int = 0           # drafts the drafter may propose for the next step
    next_token: Optional[int] = None  # a mid-prompt chunk's following prompt token (drafters shift by one)
    new: bool = False              # first step since (re)admission: its NewRequest is in this step
    # Structured output: the grammar's allowed-token bits for the sampled token, ceil(V/32) int32 (native order)
    token_bitmask: Optional[bytes] = None


class ConnectorPlan(msgspec.Struct, omit_defaults=True):
    """The KV connectors' work for one step, one part per connector (kv_transfer/__init__.py composes them)."""
    offload: Optional[OffloadPlan] = None     # KV tiers (host RAM, disk)
    transfer: Optional[TransferPlan] = None   # disaggregated prefill/decode


class ConnectorOutput(msgspec.Struct, omit_defaults=True):
    offload: Optional[OffloadOutput] = None
    transfer: Optional[TransferOutput] = None


class SchedulerOutput(msgspec.Struct, omit_defaults=True):
    new_requests: list[NewRequest] = msgspec.field(default_factory=list)
    scheduled: list[ScheduledRequest] = msgspec.field(default_factory=list)
    finished_req_ids: list[str] = msgspec.field(default_factory=list)  # the worker drops their state
    num_batched_tokens: int = 0
    num_preempted: int = 0
    spec_k: int = 0                # drafts per request this step (0: speculation off)
    num_decodes: int = 0           # requests decoding (one known token to run) this step
    num_draft_tokens: int = 0
    kv_connector_plan: Optional[ConnectorPlan] = None  # KV transfers for the worker (around the forward pass)

    @property
    def empty(self) -> bool:
        return not self.scheduled

    @property
    def needs_worker(self) -> bool:
        return bool(self.scheduled or self.finished_req_ids or self.kv_connector_plan is not None)


class ModelRunnerOutput(msgspec.Struct, omit_defaults=True):
    sampled: dict[str, list[int]] = msgspec.field(default_factory=dict)  # new tokens (accepted drafts + 1)
    logprobs: dict[str, list[PositionLogprobs]] = msgspec.field(default_factory=dict)  # one per new token
    prompt_logprobs: dict[str, list[PositionLogprobs]] = msgspec.field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)  # drafts for the next step
    kv_connector_output: Optional[ConnectorOutput] = None  # finished background KV transfers
    expert_load: Optional[list[list[int]]] = None  # MoE: tokens routed per [MoE layer][expert] this step
    # --task embed: the pooled vector (float32 little-endian bytes) of each request whose prompt ended this step
    pooled: dict[str, bytes] = msgspec.field(default_factory=dict)


_encoder = msgspec.msgpack.Encoder()
_decode_so = msgspec.msgpack.Decoder(SchedulerOutput)
_decode_out = msgspec.msgpack.Decoder(ModelRunnerOutput)


def encode(msg: SchedulerOutput | ModelRunnerOutput) -> bytes:
    return _encoder.encode(msg)


def decode_scheduler_output(data: bytes) -> SchedulerOutput:
    return _decode_so.decode(data)


def decode_runner_output(data: bytes) -> ModelRunnerOutput:
    return _decode_out.decode(data)
