"""The KV connector interface: move KV blocks between a worker's device cache and somewhere else (a slower
tier of this instance, another instance), by block id and request id.

A connector has two halves, as the engine has two sides:

- `KVConnectorScheduler` lives with the scheduler and decides. It answers lookups ("after the device
  prefix-cache hit, how many more leading tokens can you supply?"), hears which device blocks a request was
  given for them and which cached device blocks the pool is about to reuse, and packs what the worker must
  move this step into a plan (`SchedulerOutput.kv_connector_plan`, None when there is nothing to do).
- `KVConnectorWorker` lives with the device and executes. `start_step(plan)` runs before the forward pass:
  when it returns, every block this step reads is in place. Transfers it starts in the background (a slow
  tier, the network) are reported by `finished()` (`ModelRunnerOutput.kv_connector_output`), which the
  scheduler folds back in with `update()`.

Invariant: a device block named in a plan belongs to the scheduler's accounting for the whole step. Blocks
saved are ones the pool is handing out again this step, so a worker copies them out before it loads
anything into device blocks, and both happen before the forward pass writes new KV.

Hooks for connectors that send KV to another instance (disaggregated prefill, p2p_*.py):

- `on_prompt_scheduled(req, block_ids)`: req's step computes its last prompt token; once that step's forward
  pass is done, block_ids hold the prompt's KV. The worker hears of it in the same step's plan and acts in
  `after_step(plan)`, which runs after the forward pass (so a block is never offered before it is written).
- `request_finished(req, block_ids) -> (hold, params)`: called before the scheduler frees a finished request.
  hold=True keeps its blocks out of the pool (`Scheduler.held`: not running, not freed, not reused) until
  the connector names the request in `take_freeable()`, which the scheduler polls at the start of every
  step; params become the finishing `EngineCoreOutput.kv_transfer_params`. Invariant: every held request
  is eventually freeable (its blocks were pulled, or a timeout passed), so the pool becomes whole again;
  while any request is held `build_plan()` returns a plan, so the engine keeps stepping and the worker keeps
  reporting.
- Per-request parameters arrive as `Request.kv_transfer_params` (EngineCoreRequest's, vLLM's shape);
  `check_request(req)` refuses, at admission, parameters the connector would not act on safely.
- `first_token(req)`: a pulled prompt may come with the first output token the prefill instance sampled.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:  # type hints only: the step messages (step.py) import this package's plan types, and
    # the API process imports those without torch
    import torch

    from tokenmill.messages import EngineCoreRequest, Request
    from tokenmill.layers.attention.kv_quant import KVCacheQuant


@dataclass
class ExternalHit:
    num_tokens: int   # tokens after the device hit the connector supplies this step (whole blocks)
    ready: bool       # False: a background transfer started; ask again when `is_ready(request)`


class KVConnectorScheduler(ABC):
    @abstractmethod
    def lookup(self, req: Request, num_device_tokens: int) -> ExternalHit:
        """How many of req's leading tokens after its first num_device_tokens (the device prefix hit) the
        connector can supply. Holds what it found for req until `on_allocated` or `release`."""

    @abstractmethod
    def on_allocated(self, req: Request, block_ids: list[int]) -> None:
        """req was admitted with the hit of its last lookup; block_ids are the device blocks for it."""

    @abstractmethod
    def release(self, req: Request) -> None:
        """req finished, was aborted or gave up its hit: drop whatever the connector holds for it."""

    def check_request(self, req: EngineCoreRequest) -> None:
        """Raise ValueError (the request is rejected, the engine serves on) for per-request parameters this
        connector refuses; called before req is queued."""

    def is_ready(self, req: Request) -> bool:
        """Whether the background transfers req waits for have finished (successfully or not)."""
        return True

    def first_token(self, req: Request) -> Optional[int]:
        """req (waiting in `loading`, no output yet) has its first output token from elsewhere, now that the
        transfer bringing its whole prompt's KV is in: a decode instance takes the prefill instance's sample.
        The scheduler appends it as if sampled here, right after the update() that reported the transfer; the
        next lookup then supplies every prompt token. None: req samples its first token itself."""
        return None

    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        """The device pool is about to reuse a block that still holds cached KV for block_hash."""

    def on_prompt_scheduled(self, req: Request, block_ids: list[int]) -> None:
        """req's step computes its last prompt token; block_ids (all of its blocks) hold the prompt's KV once
        this step's forward pass is done."""

    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        """req finished (any reason), before its blocks are freed. Returns (hold: keep the blocks until
        `take_freeable` names req, the params for its finishing output)."""
        return False, None

    def take_freeable(self) -> list[str]:
        """Held requests whose blocks may return to the pool now (polled at the start of every step)."""
        return []

    @abstractmethod
    def build_plan(self) -> Optional[Any]:
        """What the worker moves this step (None: nothing). Called once per step, after scheduling."""

    def update(self, output: Optional[Any]) -> None:
        """Fold in what the worker reported (its `finished()`)."""

    def counters(self) -> dict[str, int]:
        return {}


class KVConnectorWorker(ABC):
    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor],
                           kv_quants: Sequence[Optional["KVCacheQuant"]] = ()) -> None:
        """The device KV tensors, each with the block index on dim 2 ([2, heads, blocks, block_size, dim]), and
        for an 8-bit cache the leading ones' quantizers (their scales say what the bytes mean; None: not
        quantized, as a drafter's cache)."""

    @abstractmethod
    def start_step(self, plan: Any) -> None:
        """Execute a plan's synchronous part; returns when the blocks this step reads are in place."""

    def after_step(self, plan: Any) -> None:
        """After the forward pass of the step whose plan this is: what that step wrote may be sent on."""

    def finished(self, wait: bool = False) -> Optional[Any]:
        """Background transfers finished since the last call. With `wait` (a step with nothing else to do)
        it may block briefly for the first one rather than let the engine loop spin."""
        return None

    def close(self) -> None:
        pass
