"""Turns a SchedulerOutput into flat batch tensors, runs the model, samples.

Per step: input_ids[T], positions[T], slot_mapping[T], query_start_loc[B+1], seq_lens[B], block_table[B, nb]
are packed with numpy (no per-token Python), logits are computed only for rows that sample or report
prompt logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.engine.request import PositionLogprobs
from tokenmill.engine.scheduler import ScheduledRequest, SchedulerOutput
from tokenmill.layers.attention.base import AttentionMetadata
from tokenmill.layers.sampler import SamplingMetadata, sample


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model, device: str, block_size: int, vocab_size: int, seed: int) -> None:
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv_caches: list[torch.Tensor] = []
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}
        self.structured = None  # StructuredOutputManager, set by the worker

    # -- inputs -----------------------------------------------------------------------------
    def _build_attention(self, reqs: list[ScheduledRequest]):
        B = len(reqs)
        qlens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=B)
        starts = np.fromiter((r.start_pos for r in reqs), dtype=np.int64, count=B)
        qsl = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(qlens, out=qsl[1:])
        T = int(qsl[-1])
        seq_lens = starts + qlens
        nb = max(len(r.block_ids) for r in reqs)
        block_table = np.zeros((B, nb), dtype=np.int64)
        for i, r in enumerate(reqs):
            block_table[i, :len(r.block_ids)] = r.block_ids
        req_of_tok = np.repeat(np.arange(B), qlens)
        positions = starts[req_of_tok] + (np.arange(T) - qsl[req_of_tok])
        slots = block_table[req_of_tok, positions // self.block_size] * self.block_size + positions % self.block_size
        input_ids = np.fromiter((t for r in reqs for t in r.token_ids), dtype=np.int64, count=T)
        to = lambda a: torch.from_numpy(a).to(self.device, non_blocking=True)  # noqa: E731
        meta = AttentionMetadata(positions=to(positions), slot_mapping=to(slots), block_table=to(block_table),
                                 query_start_loc=qsl.tolist(), seq_lens=seq_lens.tolist(),
                                 block_size=self.block_size)
        return to(input_ids), meta, qsl

    def _sampling_metadata(self, reqs: list[ScheduledRequest]) -> SamplingMetadata:
        sps = [r.sampling_params for r in reqs]
        dev = self.device
        greedy = [sp.greedy for sp in sps]
        md = SamplingMetadata(
            temperature=torch.tensor([1.0 if g else sp.temperature for g, sp in zip(greedy, sps)], device=dev),
            greedy=torch.tensor(greedy, device=dev), all_greedy=all(greedy))
        if not md.all_greedy:
            if any(sp.top_k > 0 for sp in sps):
                md.top_k = torch.tensor([sp.top_k for sp in sps], device=dev)
            if any(sp.top_p < 1.0 for sp in sps):
                md.top_p = torch.tensor([sp.top_p for sp in sps], device=dev)
            if any(sp.min_p > 0.0 for sp in sps):
                md.min_p = torch.tensor([sp.min_p for sp in sps], device=dev)
            for row, (r, sp) in enumerate(zip(reqs, sps)):
                if sp.seed is not None and not sp.greedy:
                    gen = self.request_generators.get(r.request_id)
                    if gen is None:
                        gen = self.request_generators[r.request_id] = torch.Generator(dev).manual_seed(sp.seed)
                    md.generators[row] = gen
        rep = any(sp.repetition_penalty != 1.0 for sp in sps)
        pres = any(sp.presence_penalty != 0.0 for sp in sps)
        freq = any(sp.frequency_penalty != 0.0 for sp in sps)
        if rep or pres or freq:
            md.output_tokens = self._pad([r.output_token_ids for r in reqs])
            if rep:
                md.repetition_penalty = torch.tensor([sp.repetition_penalty for sp in sps], device=dev)
                md.prompt_tokens = self._pad([r.prompt_token_ids or [] for r in reqs])
            if pres:
                md.presence_penalty = torch.tensor([sp.presence_penalty for sp in sps], device=dev)
            if freq:
                md.frequency_penalty = torch.tensor([sp.frequency_penalty for sp in sps], device=dev)
        for row, (r, sp) in enumerate(zip(reqs, sps)):
            n_out = r.start_pos + len(r.token_ids) - r.num_prompt_tokens
            if n_out < sp.min_tokens:
                ids = list(sp.stop_token_ids) + ([r.eos_token_id] if (r.eos_token_id is not None and not sp.ignore_eos) else [])
                if ids:
                    md.banned.append((row, ids))
            if sp.logit_bias:
                ids = [int(t) for t in sp.logit_bias]
                md.logit_bias.append((row, ids, [float(v) for v in sp.logit_bias.values()]))
        md.max_num_logprobs = max((sp.logprobs for sp in sps if sp.logprobs is not None), default=-1)
        if self.structured is not None:
            md.token_bitmask = self.structured.bitmask(reqs)
        return md

    def _pad(self, seqs: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(s) for s in seqs))
        arr = np.full((len(seqs), width), self.vocab_size, dtype=np.int64)
        for i, s in enumerate(seqs):
            arr[i, :len(s)] = s
        return torch.from_numpy(arr).to(self.device)

    # -- step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.request_generators.pop(rid, None)
            if self.structured is not None:
                self.structured.free(rid)
        out = ModelRunnerOutput()
        reqs = so.scheduled
        if not reqs:
            return out
        input_ids, meta, qsl = self._build_attention(reqs)
        hidden = self.model(input_ids, meta, self.kv_caches)

        sampling = [i for i, r in enumerate(reqs) if r.sample]
        if sampling:
            rows = [int(qsl[i + 1]) - 1 for i in sampling]
            logits = self.model.compute_logits(hidden[rows])
            sreqs = [reqs[i] for i in sampling]
            md = self._sampling_metadata(sreqs)
            result = sample(logits, md, self.generator)
            tokens = result.token_ids.tolist()
            if md.token_bitmask is not None:
                self.structured.accept(sreqs, tokens)
            for r, t in zip(sreqs, tokens):
                out.sampled[r.request_id] = t
            if result.logprobs is not None:
                ids, lps, ranks = (result.logprob_token_ids.tolist(), result.logprobs.tolist(),
                                   result.sampled_ranks.tolist())
                for row, r in enumerate(sreqs):
                    n = r.sampling_params.logprobs
                    if n is not None:
                        out.logprobs[r.request_id] = (ids[row][:n + 1], lps[row][:n + 1], ranks[row])

        for i, r in enumerate(reqs):
            if r.sampling_params.prompt_logprobs is not None:
                plp = self._prompt_logprobs(r, hidden, int(qsl[i]))
                if plp:
                    out.prompt_logprobs[r.request_id] = plp
        return out

    def _prompt_logprobs(self, r: ScheduledRequest, hidden: torch.Tensor, q0: int) -> list[PositionLogprobs]:
        """Position p's hidden state scores prompt token p+1."""
        first = max(r.start_pos, r.prompt_logprobs_from)
        last = min(r.start_pos + len(r.token_ids), r.num_prompt_tokens - 1)
        if first >= last:
            return []
        h = hidden[q0 + first - r.start_pos: q0 + last - r.start_pos]
        lp = self.model.compute_logits(h).log_softmax(-1)
        targets = torch.tensor(r.prompt_token_ids[first + 1:last + 1], device=lp.device)
        target_lp = lp.gather(1, targets[:, None])
        ranks = ((lp > target_lp).sum(-1) + 1).tolist()
        k = r.sampling_params.prompt_logprobs
        if k > 0:
            top_lp, top_ids = lp.topk(k, dim=-1)
            ids = torch.cat([targets[:, None], top_ids], 1).tolist()
            lps = torch.cat([target_lp, top_lp], 1).tolist()
        else:
            ids, lps = targets[:, None].tolist(), target_lp.tolist()
        return [(ids[j], lps[j], ranks[j]) for j in range(len(ranks))]
