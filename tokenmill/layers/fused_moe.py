"""Mixture-of-experts feed-forward layer: router, top-k, tokens grouped per expert, weighted combine.

Each token's hidden state goes to its top-k experts (gated MLPs: SiLU, or gpt-oss's clamped SwiGLU) and comes
back as the routing-weighted sum of their outputs. Grouping: the T*k (token, expert) pairs are sorted by expert
once (a stable argsort), so each expert's tokens are one contiguous slice of a gathered [T*k, H] activation and
each expert runs two matmuls on all its rows at once; the results are scaled by their routing weights and summed
back per token with index_add_. The only Python loop is over experts that received tokens, never over tokens.

Expert weights are stacked, w13 [E, 2*I, H] (gate rows then up rows) and w2 [E, H, I], created and run by a
quant method object (`UnquantizedMoEMethod`, `Int8MoEMethod`, quantization/fp4.py's `Mxfp4MoEMethod` for
MXFP4 checkpoints), as linear layers own theirs. gpt-oss adds a bias to the router and to both expert matmuls
(w13_bias [E, 2*I], w2_bias [E, H]: float, whatever the weights' format) and routes top-k first, then a softmax
over the chosen logits. On CPU the per-expert matmuls go through the panel-GEMM kernels of cpu_linear (each
expert's weight packed once at load): measured on this 2-core AVX2 machine, one expert of the SmolLM2-derived
MoE (w13 [3072, 576]) at 4 rows took 112 us in the panel kernel vs 503 us in F.linear, at 64 rows 1.5 vs 2.0
ms, and in bfloat16 at 64 rows 2.3 vs 7.4 ms (the measured matmul plan still hands a shape to torch where torch
wins).

Parallelism (tokenmill.distributed). Activations are replicated on every rank of the tensor-parallel group
when they reach the MLP (attention ends with an all-reduce, or is itself replicated), so every rank sees every
token and every routing decision:
- tensor parallel without EP: every rank holds every expert, with each expert's intermediate dim split
  (w13 by rows, w2 by columns, as a column/row-parallel MLP); the partial outputs are all-reduced once.
- expert parallel (`ep_size() > 1`): rank r holds experts [r*E/ep, (r+1)*E/ep) whole and computes only the
  (token, expert) pairs routed to them; the per-rank partial outputs are summed with the same single
  all-reduce. This is the all-gather + reduce form of EP: the "all-gather" of tokens is free because the
  activations are already replicated, and the reduce is the all-reduce (a reduce-scatter + all-gather inside
  the collective). An all-to-all dispatch would move only routed rows (k*T*H/ep per rank instead of T*H),
  which matters across nodes at large T; at this engine's sizes one all-reduce per layer, the same traffic
  as a dense TP MLP, is simpler and needs no token bookkeeping across ranks.
Either way, loading keeps only this rank's experts (or slices): other experts' tensors are skipped by name
before anything is copied.

Routing: softmax over the experts and top-k (Mixtral, Qwen3-MoE), or DeepSeek's grouped top-k (`GroupedTopK`):
a float32 router, softmax (V2) or sigmoid (V3) scores, experts in groups of which only the best `topk_groups`
may be chosen, V3's correction bias added for the choice only, and the chosen scores scaled by
`routed_scaling_factor`.

Expert load: every forward adds the tokens routed to each expert (all E experts: every rank sees all routing
decisions, so the counts are global on every rank) to `expert_load`, read and reset by `take_expert_load()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import ep_rank, ep_size, tp_all_reduce, tp_rank, tp_size
from tokenmill.layers import batch_invariant, cpu_linear
from tokenmill.layers.activation import silu_and_mul
from tokenmill.layers.quantization import kernels
from tokenmill.layers.quantization.int8 import quantize_int8


@dataclass(frozen=True)
class GroupedTopK:
    """DeepSeek's routers (transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter). The router weight and its
    logits are float32. A group's score is its best expert's (V2's group_limited_greedy: "max") or its two best
    summed, correction bias included (V3: "top2"); experts outside the topk_groups best groups are not chosen.
    The chosen experts' weights are their scores (without the bias), renormalised if the layer says so, times
    scaling_factor."""
    sigmoid: bool                   # V3 scores with a sigmoid, V2 with a softmax
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"        # "max" or "top2"
    correction_bias: bool = False   # V3's e_score_correction_bias [E] (float32), a checkpoint tensor of the gate
    scaling_factor: float = 1.0


class UnquantizedMoEMethod:
    """Float expert weights; per-expert matmuls through cpu_linear (panel GEMM on CPU, F.linear elsewhere)."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                       dtype: torch.dtype) -> None:
        layer.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype),
                                        requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype),
                                       requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # one packed copy per expert (cpu_linear.pack: None off CPU or past the packing budget)
        self.w13_panels = [cpu_linear.pack(w) for w in layer.w13_weight.data]
        self.w2_panels = [cpu_linear.pack(w) for w in layer.w2_weight.data]

    def load_expert(self, layer: nn.Module, local: int, proj: str, weight, rows: tuple[int, int],
                    cols: tuple[int, int]) -> None:
        """Copy rows/cols ((start, count) each: this rank's part) of one expert's checkpoint tensor in."""
        layer.copy_expert(local, proj, weight[rows[0]:rows[0] + rows[1], cols[0]:cols[0] + cols[1]])

    def apply(self, layer: nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert` (local index) on its rows x [n, H] -> [n, H] (this rank's partial sum under TP)."""
        p13 = getattr(self, "w13_panels", None)
        h = cpu_linear.linear(x, layer.w13_weight[expert], layer.expert_bias("w13", expert),
                              p13[expert] if p13 else None)
        p2 = getattr(self, "w2_panels", None)
        return cpu_linear.linear(layer.act(h), layer.w2_weight[expert], layer.expert_bias("w2", expert),
                                 p2[expert] if p2 else None)


class Int8MoEMethod(UnquantizedMoEMethod):
    """int8 weight-only experts: symmetric, one scale per output channel of each expert (quantized on load,
    like quantization/int8.py's linear method). Decode-sized row counts run the integer CPU kernel
    (activations on a 16-bit grid); larger ones widen the expert's weight once and use MKL."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for name in ("w13", "w2"):
            pairs = [quantize_int8(w) for w in getattr(layer, f"{name}_weight").data]
            q = torch.stack([p[0] for p in pairs])
            s = torch.stack([p[1] for p in pairs])
            setattr(layer, f"{name}_weight", nn.Parameter(q, requires_grad=False))
            setattr(layer, f"{name}_scale", nn.Parameter(s, requires_grad=False))
            setattr(self, f"{name}_runs", [kernels.bind_int8(q[e], s[e], kernels.ACT_QMAX_A16)
                                           for e in range(q.shape[0])])

    def _linear(self, layer: nn.Module, name: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        q, s = getattr(layer, f"{name}_weight")[expert], getattr(layer, f"{name}_scale")[expert]
        run, bias = getattr(self, f"{name}_runs")[expert], layer.expert_bias(name, expert)
        if run is not None and x.is_cpu and (batch_invariant.enabled() or x.shape[0] <= kernels.FUSED_MAX_ROWS):
            return run(x, bias)
        return kernels.qlinear(kernels.QFMT_INT8, x, q, None, s, q.shape[1], bias=bias)

    def apply(self, layer: nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self._linear(layer, "w2", expert, layer.act(self._linear(layer, "w13", expert, x)))


class FusedMoE(nn.Module):
    """Router + E gated experts, top_k per token (see the module doc for grouping and parallelism).

    renormalize: divide the top-k probabilities by their sum (Mixtral always; Qwen3-MoE if norm_topk_prob).
    float32_scores: the routing weights stay float32 when they scale the expert outputs (Mixtral in
    transformers); otherwise they are cast to the model dtype first (Qwen3-MoE). Equal in float32 models.
    topk_softmax: the top-k router logits first, then a softmax over those alone (gpt-oss), instead of a softmax
    over all experts then the top-k. bias: a router bias and expert biases (gpt-oss). act: the experts'
    activation over [gate | up] -> [I] (activation.silu_and_mul; gpt-oss: activation.ClampedSwiGLU).
    grouped: DeepSeek's grouped top-k (GroupedTopK) instead of softmax + top-k.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype, renormalize: bool, float32_scores: bool = True, quant_method=None, *,
                 topk_softmax: bool = False, bias: bool = False, act=silu_and_mul,
                 grouped: Optional[GroupedTopK] = None) -> None:
        super().__init__()
        ep, tp = ep_size(), tp_size()
        if num_experts % ep:
            raise ValueError(f"{num_experts} experts cannot be split evenly over expert-parallel size {ep}; "
                             f"use a tensor-parallel size that divides {num_experts}")
        # under EP the experts are split and each stays whole; without it each expert's width is split
        split = 1 if ep > 1 else tp
        if intermediate_size % split:
            raise ValueError(f"expert intermediate size {intermediate_size} is not divisible by tensor-parallel "
                             f"size {tp}; enable expert parallelism or pick a size that divides it")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, {num_experts}]")
        if grouped is not None and (num_experts % grouped.num_groups
                                    or not 0 < grouped.topk_groups <= grouped.num_groups):
            raise ValueError(f"n_group={grouped.num_groups} must divide the {num_experts} experts and topk_group="
                             f"{grouped.topk_groups} must be in [1, n_group]")
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.num_local_experts = num_experts // ep
        self.expert_start = ep_rank() * self.num_local_experts
        self.intermediate_size = intermediate_size // split  # this rank's part of each expert
        self.full_intermediate_size = intermediate_size
        self.intermediate_rank = tp_rank() if split > 1 else 0
        self.renormalize, self.float32_scores, self.topk_softmax = renormalize, float32_scores, topk_softmax
        self.grouped, self.act, self.dtype = grouped, act, dtype
        # The router stays a plain weight in the model dtype, like transformers' (logits in the model dtype,
        # softmax in float32; DeepSeek's all float32); not a LinearBase, so online quantization never perturbs
        # the routing.
        self.gate = nn.Module()
        gate_dtype = dtype if grouped is None else torch.float32
        self.gate.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=gate_dtype), requires_grad=False)
        self.gate.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype), requires_grad=False) if bias else None
        if grouped is not None and grouped.correction_bias:
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                             requires_grad=False)
        # Expert biases are float in every expert format. Each expert's down-projection output is a partial sum
        # on each rank when its width is split, so its bias must be added once in all: each rank holds and adds
        # its 1/tp of the hidden columns (bias_cols), and the all-reduce assembles it.
        self.bias_cols = None
        if bias:
            E, n, H = self.num_local_experts, self.intermediate_size, hidden_size
            if split > 1:
                if H % tp:
                    raise ValueError(f"hidden size {H} is not divisible by tensor-parallel size {tp}")
                self.bias_cols = (tp_rank() * (H // tp), H // tp)
            self.w13_bias = nn.Parameter(torch.empty(E, 2 * n, dtype=dtype), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(E, H // split, dtype=dtype), requires_grad=False)
        self.quant_method = None
        self.use_quant_method(quant_method or UnquantizedMoEMethod())
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self._loaded: set[tuple[int, str]] = set()
        self._rows_loaded: set[tuple[str, int, int]] = set()  # copy_rows: (parameter, local expert, first row)

    def use_quant_method(self, method) -> None:
        """Install `method` and let it create the expert weights (replacing the float ones): construction, or a
        checkpoint format's method installed before the weights load (quantization.apply_quantization)."""
        self.quant_method = method
        method.create_weights(self, self.num_local_experts, self.hidden_size, self.intermediate_size, self.dtype)

    def expert_bias(self, name: str, expert: int) -> Optional[torch.Tensor]:
        """Local expert's bias for `name` ('w13' or 'w2') that the quant method adds in its matmul, or None (no
        biases; w2's when the width is split: forward adds this rank's columns of it)."""
        bias = getattr(self, f"{name}_bias", None)
        if bias is None or (name == "w2" and self.bias_cols is not None):
            return None
        return bias[expert]

    # -- forward ------------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k], expert ids [T, k]) exactly as transformers computes them."""
        # batch-invariant mode: the C kernel's fixed reduction order, so a token's routing ignores its batch
        linear = cpu_linear.linear if batch_invariant.enabled() else F.linear
        if self.grouped is not None:
            return self._grouped_route(linear(x.float(), self.gate.weight))
        logits = linear(x, self.gate.weight, self.gate.bias)
        if self.topk_softmax:  # gpt-oss: softmax over the chosen logits, in their dtype (as transformers)
            top, ids = logits.topk(self.top_k, dim=-1)
            weights = top.softmax(dim=-1)
            return (weights.float() if self.float32_scores else weights.to(x.dtype)), ids
        probs = logits.float().softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_scores else weights.to(x.dtype)), ids

    def _grouped_route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g, T, E = self.grouped, logits.shape[0], self.num_experts
        scores = logits.sigmoid() if g.sigmoid else logits.softmax(dim=-1)
        choice = scores + self.gate.e_score_correction_bias if g.correction_bias else scores
        if g.num_groups > 1:
            per_group = choice.view(T, g.num_groups, E // g.num_groups)
            group_scores = per_group.topk(2, dim=-1)[0].sum(-1) if g.group_score == "top2" else per_group.amax(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(g.topk_groups, dim=-1)[1], True)
            choice = choice.masked_fill(~keep.repeat_interleave(E // g.num_groups, dim=1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * g.scaling_factor, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.expert_load += counts
        # (token, expert) pairs sorted by expert: each expert's rows are one slice; keep this rank's experts
        order = torch.argsort(flat, stable=True)
        local = counts[self.expert_start:self.expert_start + self.num_local_experts].tolist()
        begin = int(counts[:self.expert_start].sum())
        order = order[begin:begin + sum(local)]
        tokens = order // self.top_k
        rows = x[tokens]
        out = torch.empty_like(rows)
        offset = 0
        for e, n in enumerate(local):
            if n:
                out[offset:offset + n] = self.quant_method.apply(self, e, rows[offset:offset + n])
                if self.bias_cols is not None:
                    c0, width = self.bias_cols
                    out[offset:offset + n, c0:c0 + width] += self.w2_bias[e]
                offset += n
        out = (out * weights.reshape(-1)[order, None]).to(x.dtype)
        y = torch.zeros_like(x).index_add_(0, tokens, out)
        return tp_all_reduce(y)  # (a no-op on one rank)

    def take_expert_load(self) -> torch.Tensor:
        """Tokens routed to each of the E experts since the last call (and reset)."""
        load = self.expert_load.clone()
        self.expert_load.zero_()
        return load

    # -- loading ------------------------------------------------------------------------------
    # Checkpoint tensors may be lazy (models/loader.py: .shape and slicing read only the sliced bytes), so they
    # are only ever sliced here: a rank reads its experts' (and its width's) part, nothing else.
    def _local(self, expert: int) -> Optional[int]:
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range: the layer has {self.num_experts} experts")
        local = expert - self.expert_start
        return local if 0 <= local < self.num_local_experts else None

    def _check(self, what: str, shape, expected: tuple[int, ...]) -> None:
        if tuple(shape) != expected:
            raise ValueError(f"{what} has shape {tuple(shape)}, expected {expected}")

    def copy_expert(self, local: int, proj: str, part: torch.Tensor) -> None:
        """Float experts: `part` (this rank's slice of local expert's proj) into the stacked weights."""
        n = self.intermediate_size
        if proj == "down":
            self.w2_weight.data[local].copy_(part)
        else:
            offset = 0 if proj == "gate" else n
            self.w13_weight.data[local, offset:offset + n].copy_(part)
        self._loaded.add((local, proj))



    def holds(self, expert: int) -> bool:
        """Whether this rank holds expert `expert` (all of them without expert parallelism)."""
        return self._local(expert) is not None

    def copy_rows(self, name: str, expert: int, first: int, part: torch.Tensor) -> None:
        """Copy `part` (this rank's slice, already in the parameter's layout) into rows [first, first + len) of
        expert `expert`'s (global id, held here) stacked parameter `name` (w13_weight, w2_scale, w13_bias, ...)."""
        param, local = getattr(self, name), self._local(expert)
        target = param.data[local, first:first + part.shape[0]]
        self._check(f"expert {expert} {name} rows {first}..", part.shape, tuple(target.shape))
        target.copy_(part)
        self._rows_loaded.add((name, local, first))

    def complete_params(self) -> set[str]:
        """Names of the stacked parameters copy_rows filled for every local expert (w13 parameters: its gate and
        its up rows; the others: whole)."""
        counts: dict[str, int] = {}
        for name, _, _ in self._rows_loaded:
            counts[name] = counts.get(name, 0) + 1
        return {name for name, c in counts.items()
                if c == self.num_local_experts * (2 if name.startswith("w13") else 1)}

    def load_expert(self, expert: int, proj: str, weight) -> bool:
        """Copy in one expert's HF tensor: proj 'gate' or 'up' ([I, H]) or 'down' ([H, I]). Returns False,
        reading nothing, for an expert another rank holds."""
        local = self._local(expert)
        if local is None:
            return False
        n, r, full, H = self.intermediate_size, self.intermediate_rank, self.full_intermediate_size, self.hidden_size
        self._check(f"expert {expert} {proj} weight", weight.shape, (H, full) if proj == "down" else (full, H))
        rows, cols = ((0, H), (r * n, n)) if proj == "down" else ((r * n, n), (0, H))
        self.quant_method.load_expert(self, local, proj, weight, rows, cols)
        self._loaded.add((local, proj))
        return True

    def load_stacked(self, kind: str, weight) -> None:
        """transformers 5's stacked layout: 'gate_up_proj' [E, 2*I, H] (gate rows, then up) or 'down_proj'
        [E, H, I]; only this rank's experts and width are read."""
        E, n, r, full, H = self.num_experts, self.intermediate_size, self.intermediate_rank, \
            self.full_intermediate_size, self.hidden_size
        if kind == "down_proj":
            self._check("experts' down_proj", weight.shape, (E, H, full))
        else:
            self._check("experts' gate_up_proj", weight.shape, (E, 2 * full, H))
        lo, hi = self.expert_start, self.expert_start + self.num_local_experts
        if kind == "down_proj":
            for local, part in enumerate(weight[lo:hi, :, r * n:(r + 1) * n]):
                self.copy_expert(local, "down", part)
            return
        for proj, base in (("gate", 0), ("up", full)):
            for local, part in enumerate(weight[lo:hi, base + r * n:base + (r + 1) * n]):
                self.copy_expert(local, proj, part)

    def experts_loaded(self) -> bool:
        return len(self._loaded) == 3 * self.num_local_experts

    def loaded_params(self) -> set[str]:
        """This layer's expert parameters now loaded for every local expert (the router's go through the model's
        loader): all the weights once load_expert / load_stacked saw every expert, and what copy_rows filled."""
        done = self.complete_params()
        if self.experts_loaded():
            done |= {n for n, _ in self.named_parameters()
                     if not n.startswith("gate.") and n not in ("w13_bias", "w2_bias")}
        return done
