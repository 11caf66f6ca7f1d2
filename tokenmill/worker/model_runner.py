"""Turns a SchedulerOutput into flat batch tensors, runs the model, samples (verifies drafts), drafts.

Per step: input_ids[T], positions[T], slot_mapping[T], query_start_loc[B+1], seq_lens[B], block_table[B, nb]
(a slot mapping and block table per KV group: step/kv_groups.py) are packed with numpy (no per-token Python),
logits are computed only for rows that sample or report prompt logprobs. A request with k draft tokens runs
them as its last k query tokens; its last k + 1 rows get logits and go through the rejection sampler instead
of the plain sampler.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from tokenmill.config import PoolerConfig
from tokenmill.distributed import IntermediateTensors, pp_rank, pp_recv, pp_send, pp_size
from tokenmill.layers.pooler import pool
from tokenmill.layers.sampler import (SamplingMetadata, apply_logits_processors, logprobs_of, sample)
from tokenmill.spec_decode import DraftBatch, DraftRequest, Proposer
from tokenmill.spec_decode.rejection_sampler import rejection_sample
from tokenmill.step import ModelRunnerOutput, PositionLogprobs, ScheduledRequest, SchedulerOutput
from tokenmill.step.interrupt import StepInterrupt
from tokenmill.step.kv_groups import KVLayout
from tokenmill.models.flat_batch import flat_batch, group_block_tables
from tokenmill.worker.lora_manager import LoRAManager
from tokenmill.worker.multimodal import MultimodalInputs
from tokenmill.worker.request_states import RequestStates


def _mix32(x: int) -> int:
    """MurmurHash3's 32-bit finalizer: a bijection of 32-bit integers with _mix32(0) == 0."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def generator_seed(seed: int, device) -> int:
    """The seed a request's torch.Generator gets. The CPU generator (mt19937) keeps only the low 32 bits of
    its seed, so seeds 2^32 apart (5 and 5 - 2^63) sampled identically; here the high half is hashed into
    the low one. Seeds in [0, 2^32) keep their streams; a CPU generator still has only 2^32 streams, so two
    arbitrary 64-bit seeds collide with probability 2^-32, but no longer by a pattern. CUDA's Philox
    generator takes all 64 bits as they are."""
    if torch.device(device).type != "cpu":
        return seed
    seed &= 0xFFFFFFFFFFFFFFFF  # two's complement, as torch reads a negative seed
    return (seed & 0xFFFFFFFF) ^ _mix32(seed >> 32)


class ModelRunner:
    def __init__(self, model, device: str, block_size: int, vocab_size: int, seed: int,
                 drafter: Optional[Proposer] = None, max_model_len: int = 0,
                 pooler: Optional[PoolerConfig] = None, kv_layout: Optional[KVLayout] = None,
                 lora: Optional[LoRAManager] = None, step_interrupt: Optional[StepInterrupt] = None) -> None:
        """kv_layout: the KV groups (default one group of every layer); lora: the adapters (--enable-lora);
        step_interrupt: lets the engine cut a step short between layers (step/interrupt.py)."""
        self.model = model
        self.step_interrupt = step_interrupt
        self.lora = lora
        self.pooler = pooler  # --task embed: pool the prompt's hidden states instead of sampling
        self.device = torch.device(device)
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_caches: list[torch.Tensor] = []  # per layer: its KV group's slot tensor
        num_groups = len(kv_layout.groups) if kv_layout is not None else 1
        self.layer_group = kv_layout.layer_group if num_groups > 1 else ()  # model layer index -> KV group
        self.states = RequestStates(num_groups)  # the worker's copy of each running request (tokenmill/step/)
        self.stage, self.num_stages = pp_rank(), pp_size()  # pipeline stage: only the last one samples
        self.count_experts = hasattr(model, "expert_load")  # MoE: tokens routed per expert, for /metrics
        # a VLM: M-RoPE positions and encoded images per request
        self.mm = MultimodalInputs(model) if hasattr(model, "encode_image") else None
        self._sending: list = []  # a pipeline stage's pending sends of its last step's hidden states ...
        self._sent: list[torch.Tensor] = []  # ... and those tensors
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}
        self.drafter = drafter
        self._aux: list[torch.Tensor] = []
        if drafter is not None:
            for i in drafter.aux_layers:  # capture the residual stream entering these target layers
                model.layers[i].register_forward_pre_hook(self._capture_aux)

    def _capture_aux(self, module, args) -> None:
        x, residual = args[0], args[1]
        self._aux.append(x if residual is None else x + residual)

    # -- inputs -----------------------------------------------------------------------------
    def _build_attention(self, reqs: list[ScheduledRequest]):
        B = len(reqs)
        qlens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=B)
        starts = np.fromiter((r.start_pos for r in reqs), dtype=np.int64, count=B)
        input_ids = np.fromiter((t for r in reqs for t in r.token_ids), dtype=np.int64, count=int(qlens.sum()))
        tables = group_block_tables([self.states[r.request_id].block_ids for r in reqs])  # [G, B, nb]
        adapters = self.lora is not None and self.lora.prepare([self.states[r.request_id].lora_request
                                                                for r in reqs], qlens)
        rope = self.mm.rope_positions(reqs, self.states) if self.mm is not None else None
        return flat_batch(input_ids, qlens, starts, tables, self.block_size, self.device, self.layer_group, adapters,
                          rope, self.step_interrupt)

    def _generator(self, r: ScheduledRequest) -> Optional[torch.Generator]:
        sp = self.states[r.request_id].sampling_params
        if sp.seed is None or sp.greedy:
            return None
        gen = self.request_generators.get(r.request_id)
        if gen is None:
            gen = torch.Generator(self.device).manual_seed(generator_seed(sp.seed, self.device))
            self.request_generators[r.request_id] = gen
        return gen

    def _sampling_metadata(self, reqs: list[ScheduledRequest], rows: Optional[list[int]] = None) -> SamplingMetadata:
        """One row per request, or rows[i] consecutive rows for request i (its verified positions; the
        per-request generators are then left to the caller)."""
        states = [self.states[r.request_id] for r in reqs]
        sps = [st.sampling_params for st in states]
        dev = self.device
        greedy = [sp.greedy for sp in sps]
        rep = torch.tensor(rows, device=dev) if rows is not None else None

        def per_row(values, dtype=None):
            t = torch.tensor(values, device=dev, dtype=dtype)
            return t if rep is None else t.repeat_interleave(rep)

        md = SamplingMetadata(temperature=per_row([1.0 if g else sp.temperature for g, sp in zip(greedy, sps)]),
                              greedy=per_row(greedy), all_greedy=all(greedy))
        if not md.all_greedy:
            if any(sp.top_k > 0 for sp in sps):
                md.top_k = per_row([sp.top_k for sp in sps])
            if any(sp.top_p < 1.0 for sp in sps):
                md.top_p = per_row([sp.top_p for sp in sps])
            if any(sp.min_p > 0.0 for sp in sps):
                md.min_p = per_row([sp.min_p for sp in sps])
            if rows is None:
                for row, r in enumerate(reqs):
                    gen = self._generator(r)
                    if gen is not None:
                        md.generators[row] = gen
        rep = any(sp.repetition_penalty != 1.0 for sp in sps)
        pres = any(sp.presence_penalty != 0.0 for sp in sps)
        freq = any(sp.frequency_penalty != 0.0 for sp in sps)
        if rep or pres or freq:
            md.output_tokens = self._pad([st.output_token_ids for st in states])
            if rep:
                md.repetition_penalty = torch.tensor([sp.repetition_penalty for sp in sps], device=dev)
                md.prompt_tokens = self._pad([st.prompt_token_ids for st in states])
            if pres:
                md.presence_penalty = torch.tensor([sp.presence_penalty for sp in sps], device=dev)
            if freq:
                md.frequency_penalty = torch.tensor([sp.frequency_penalty for sp in sps], device=dev)
        row = 0
        for i, (r, st, sp) in enumerate(zip(reqs, states, sps)):
            count = 1 if rows is None else rows[i]
            for j in range(count):  # row j samples output token number n_out
                n_out = r.start_pos + len(r.token_ids) - count + 1 + j - st.num_prompt_tokens
                if n_out < sp.min_tokens:
                    ids = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(st.eos_token_ids))
                    if ids:
                        md.banned.append((row + j, ids))
                if sp.logit_bias:
                    ids = [int(t) for t in sp.logit_bias]
                    md.logit_bias.append((row + j, ids, [float(v) for v in sp.logit_bias.values()]))
            row += count
        md.max_num_logprobs = max((sp.logprobs for sp in sps if sp.logprobs is not None), default=-1)
        if rows is None and any(r.token_bitmask is not None for r in reqs):  # the scheduler's grammar masks
            md.token_bitmask = torch.stack([self._allow_all if r.token_bitmask is None else
                                            torch.frombuffer(bytearray(r.token_bitmask), dtype=torch.int32)
                                            for r in reqs])
        return md

    @property
    def _allow_all(self) -> torch.Tensor:
        return torch.full(((self.vocab_size + 31) // 32,), -1, dtype=torch.int32)

    def _pad(self, seqs: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(s) for s in seqs))
        arr = np.full((len(seqs), width), self.vocab_size, dtype=np.int64)
        for i, s in enumerate(seqs):
            arr[i, :len(s)] = s
        return torch.from_numpy(arr).to(self.device)

    # -- step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.states.apply(so)
        for rid in so.finished_req_ids:
            self.request_generators.pop(rid, None)
        if self.mm is not None:
            self.mm.drop(so.finished_req_ids)
        if self.drafter is not None and so.finished_req_ids:
            self.drafter.free(so.finished_req_ids)
        out = ModelRunnerOutput()
        reqs = so.scheduled
        if not reqs:
            return out
        input_ids, meta, qsl = self._build_attention(reqs)
        self._aux.clear()
        images = self.mm.image_rows(reqs, self.states, qsl) if self.mm is not None and self.stage == 0 else None
        hidden = self._forward(input_ids, meta, images)
        if hidden is None:  # a pipeline stage before the last: its part is done
            return out
        if self.pooler is not None:
            return self._pool(reqs, qsl, hidden, out)

        plain = [i for i, r in enumerate(reqs) if r.sample and not r.num_spec]
        spec = [i for i, r in enumerate(reqs) if r.sample and r.num_spec]
        rows = [int(qsl[i + 1]) - 1 for i in plain]
        for i in spec:
            rows.extend(range(int(qsl[i + 1]) - 1 - reqs[i].num_spec, int(qsl[i + 1])))
        if rows:
            logits = self.model.compute_logits(hidden[rows])
            if plain:
                self._sample([reqs[i] for i in plain], logits[:len(plain)], out)
            if spec:
                self._verify([reqs[i] for i in spec], logits[len(plain):], out)

        for i, r in enumerate(reqs):
            if self.states[r.request_id].sampling_params.prompt_logprobs is not None:
                plp = self._prompt_logprobs(r, hidden, int(qsl[i]))
                if plp:
                    out.prompt_logprobs[r.request_id] = plp
        if self.drafter is not None:
            out.spec_token_ids = self._draft(reqs, qsl, hidden, out)
        self._aux.clear()
        if self.count_experts:
            load = self.model.expert_load()  # this stage's MoE layers; resets the layers' counters
            out.expert_load = load.tolist() if load is not None else None
        return out

    def _pool(self, reqs: list[ScheduledRequest], qsl: np.ndarray, hidden: torch.Tensor,
              out: ModelRunnerOutput) -> ModelRunnerOutput:
        """--task embed: requests whose prompt ends this step get their pooled vector (a whole-prompt pooler's
        requests always run whole, so their rows here are the whole prompt)."""
        done = [i for i, r in enumerate(reqs) if r.sample]
        if done:
            vecs = pool(hidden, [int(qsl[i]) for i in done], [int(qsl[i + 1]) for i in done], self.pooler.method,
                        self.pooler.normalize)
            out.pooled = {reqs[i].request_id: v for i, v in zip(done, vecs)}
        return out

    def _forward(self, input_ids: torch.Tensor, meta, images=None) -> Optional[torch.Tensor]:
        """This stage's layers: a stage after the first takes the previous one's hidden states and residual
        (stages run the steps in the same order, so the point-to-point messages pair up), a stage before the
        last hands them on and returns None. images: a VLM's image tokens for the step's placeholder rows."""
        intermediate = None
        if self.stage > 0:
            shape = (input_ids.shape[0], self.model.config.hidden_size)
            hidden, residual = pp_recv([shape, shape], self.model.dtype, self.stage - 1, self.device)
            intermediate = IntermediateTensors(hidden, residual)
        extra = {} if images is None else {"image_rows": images}
        out = self.model(input_ids, meta, self.kv_caches, intermediate, **extra)
        if self.stage == self.num_stages - 1:
            return out
        for work in self._sending:  # the previous step's hand-off has landed (stages run steps in order)
            work.wait()
        tensors = [out.hidden.contiguous(), out.residual.contiguous()]
        self._sending = pp_send(tensors, self.stage + 1)
        self._sent = tensors  # alive until those sends complete
        return None

    def _sample(self, sreqs: list[ScheduledRequest], logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        md = self._sampling_metadata(sreqs)
        result = sample(logits, md, self.generator)
        tokens = result.token_ids.tolist()
        for r, t in zip(sreqs, tokens):
            out.sampled[r.request_id] = [t]
        if result.logprobs is not None:
            ids, lps, ranks = (result.logprob_token_ids.tolist(), result.logprobs.tolist(),
                               result.sampled_ranks.tolist())
            for row, r in enumerate(sreqs):
                n = self.states[r.request_id].sampling_params.logprobs
                if n is not None:
                    out.logprobs[r.request_id] = [(ids[row][:n + 1], lps[row][:n + 1], ranks[row])]

    def _verify(self, sreqs: list[ScheduledRequest], logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Rejection-sample each request's k + 1 rows against its k drafts (proposed greedily: one-hot q)."""
        counts = [r.num_spec + 1 for r in sreqs]
        md = self._sampling_metadata(sreqs, counts)
        raw = logits.log_softmax(-1) if md.max_num_logprobs >= 0 else None
        drafts = torch.tensor([t for r in sreqs for t in r.token_ids[len(r.token_ids) - r.num_spec:]],
                              dtype=torch.long, device=logits.device)
        gens = {b: g for b, g in ((b, self._generator(r)) for b, r in enumerate(sreqs)) if g is not None}
        greedy = torch.tensor([self.states[r.request_id].sampling_params.greedy for r in sreqs], device=logits.device)
        res = rejection_sample(apply_logits_processors(logits, md), [r.num_spec for r in sreqs], drafts, md,
                               greedy, None, self.generator, gens)
        for r, toks in zip(sreqs, res.token_ids):
            out.sampled[r.request_id] = toks
        if raw is not None:
            ids, lps, ranks = (x.tolist() for x in logprobs_of(raw, res.rows, md.max_num_logprobs))
            row = 0
            for r, toks, c in zip(sreqs, res.token_ids, counts):
                n = self.states[r.request_id].sampling_params.logprobs
                if n is not None:
                    out.logprobs[r.request_id] = [(ids[row + j][:n + 1], lps[row + j][:n + 1], ranks[row + j])
                                                  for j in range(len(toks))]
                row += c

    def _draft(self, reqs: list[ScheduledRequest], qsl: np.ndarray, hidden: torch.Tensor,
               out: ModelRunnerOutput) -> dict[str, list[int]]:
        dreqs = []
        for i, r in enumerate(reqs):
            st = self.states[r.request_id]
            toks = out.sampled.get(r.request_id)
            accepted = len(toks) - 1 if (toks is not None and r.num_spec) else 0
            n_valid = len(r.token_ids) - r.num_spec + accepted
            dreqs.append(DraftRequest(
                request_id=r.request_id, start_pos=r.start_pos, computed=r.token_ids[:n_valid], q0=int(qsl[i]),
                next_token=toks[-1] if toks is not None else r.next_token, sampled=toks is not None,
                block_ids=st.block_ids[0], num_propose=r.num_propose if toks is not None else 0,
                num_spec=r.num_spec, num_accepted=accepted, new=r.new,
                history=st.tokens_before(r.start_pos) if (r.new and self.drafter.wants_history) else None))
        aux = torch.cat(self._aux, -1) if self._aux else None
        return self.drafter.propose(DraftBatch(dreqs, hidden, aux, self.max_model_len))

    def _prompt_logprobs(self, r: ScheduledRequest, hidden: torch.Tensor, q0: int) -> list[PositionLogprobs]:
        """Position p's hidden state scores prompt token p+1."""
        st = self.states[r.request_id]
        first = max(r.start_pos, r.prompt_logprobs_from)
        last = min(r.start_pos + len(r.token_ids), st.num_prompt_tokens - 1)
        if first >= last:
            return []
        h = hidden[q0 + first - r.start_pos: q0 + last - r.start_pos]
        lp = self.model.compute_logits(h).log_softmax(-1)
        targets = torch.tensor(st.prompt_token_ids[first + 1:last + 1], device=lp.device)
        target_lp = lp.gather(1, targets[:, None])
        ranks = ((lp > target_lp).sum(-1) + 1).tolist()
        k = st.sampling_params.prompt_logprobs
        if k > 0:
            top_lp, top_ids = lp.topk(k, dim=-1)
            ids = torch.cat([targets[:, None], top_ids], 1).tolist()
            lps = torch.cat([target_lp, top_lp], 1).tolist()
        else:
            ids, lps = targets[:, None].tolist(), target_lp.tolist()
        return [(ids[j], lps[j], ranks[j]) for j in range(len(ranks))]
