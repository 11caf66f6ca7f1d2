"""Process groups for tensor, pipeline and expert parallelism, and the collectives the model layers call.

A run of world size tp * pp has rank = pp_rank * tp + tp_rank: the tp ranks of one pipeline stage are
consecutive (one node's devices), and the ranks holding the same tensor shard across stages form a pipeline
group. Expert parallelism shards experts over the tensor-parallel group (attention stays TP).

A single-process run is the degenerate case: rank 0 of size 1, every collective a no-op, so model code is
written once. The state is per process (each rank is one process), set once by init_distributed() in the
worker before the model is built, and never changed after. Collectives carry a timeout: a rank that dies
makes the others raise instead of hanging.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    expert_parallel: bool = False
    tp_group: Optional[object] = None  # torch.distributed ProcessGroup of this rank's tensor-parallel ranks
    pp_group: Optional[object] = None  # ... of this rank's pipeline (same tp_rank in every stage)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size


_state = ParallelState()


def init_distributed(rank: int, tp_size: int, pp_size: int, init_method: str, backend: str = "gloo",
                     timeout_s: float = 60.0, expert_parallel: bool = False) -> ParallelState:
    """Join the world (torch.distributed) and build this rank's groups. Call once per process."""
    global _state
    world = tp_size * pp_size
    timeout = datetime.timedelta(seconds=timeout_s)
    if world > 1:
        dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank, timeout=timeout)
    tp_group = pp_group = None
    if world > 1:
        # new_group is collective: every rank creates every group, in the same order
        for stage in range(pp_size):
            ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                tp_group = g
        for t in range(tp_size):
            ranks = list(range(t, world, tp_size))
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                pp_group = g
    _state = ParallelState(tp_size, pp_size, rank, expert_parallel, tp_group, pp_group)
    return _state


def destroy_distributed() -> None:
    global _state
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()


def state() -> ParallelState:
    return _state


def tp_size() -> int:
    return _state.tp_size


def tp_rank() -> int:
    return _state.tp_rank


def pp_size() -> int:
    return _state.pp_size


def pp_rank() -> int:
    return _state.pp_rank


def ep_size() -> int:
    """Ranks the experts of a MoE layer are spread over (1 without --enable-expert-parallel)."""
    return _state.tp_size if _state.expert_parallel else 1


def ep_rank() -> int:
    return _state.tp_rank if _state.expert_parallel else 0


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel ranks, in place."""
    if _state.tp_size > 1:
        dist.all_reduce(x, group=_state.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate the tensor-parallel ranks' x along dim (rank order)."""
    if _state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_state.tp_group)
    return torch.cat(parts, dim)


def pp_global_rank(stage: int) -> int:
    """The global rank of pipeline stage `stage` that shares this rank's tensor shard."""
    return stage * _state.tp_size + _state.tp_rank


def tp_all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Element-wise max over the tensor-parallel ranks, in place (e.g. a weight row's max |w| when each rank
    holds part of the row)."""
    if _state.tp_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_state.tp_group)
    return x


# -- pipeline parallel ------------------------------------------------------------------------------------
@dataclass
class IntermediateTensors:
    """What one pipeline stage hands the next: the hidden states and the residual stream, both [T, hidden]."""
    hidden: torch.Tensor
    residual: torch.Tensor


def stage_layers(num_layers: int, counts: Optional[list[int]] = None) -> tuple[int, int]:
    """[start, end) of the decoder layers this rank's pipeline stage runs. counts: layers per stage
    (ParallelConfig.layers_per_stage, which also validates a --pp-layer-partition); default an even split."""
    pp = _state.pp_size
    if counts is None:
        from tokenmill.config import ParallelConfig  # ~11 ms: `tokenmill quantize` imports this module without it

        counts = ParallelConfig(pipeline_parallel_size=pp).layers_per_stage(num_layers)
    if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"a layer partition {counts} must give each of the {pp} pipeline stages at least one of "
                         f"the model's {num_layers} layers")
    start = sum(counts[:_state.pp_rank])
    return start, start + counts[_state.pp_rank]


def pp_send(tensors: list[torch.Tensor], to_stage: int) -> list:
    """Start sending tensors, in order, to pipeline stage `to_stage`'s rank with this rank's tensor shard.
    Returns the pending sends: wait() on them before reusing the tensors (the caller keeps them alive), so
    this stage can start its next step while the next stage receives (a blocking send waits for its recv)."""
    dst = pp_global_rank(to_stage)
    return [dist.isend(t, dst=dst, group=_state.pp_group) for t in tensors]


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, from_stage: int,
            device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Receive what pp_send sent from stage `from_stage`: the receiver knows the shapes (the step's token count
    and the hidden size) and the dtype (the model's), so nothing but the data crosses the wire."""
    src = pp_global_rank(from_stage)
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=src, group=_state.pp_group)
        out.append(t)
    return out
