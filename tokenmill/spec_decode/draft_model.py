"""Draft-model drafter: a smaller model with the target's tokenizer, its own paged KV cache over the target's
block ids, run for the whole batch: one catch-up pass, then k - 1 single-token steps. Proposals are greedy
(one-hot q for the rejection sampler).

The draft runs only for requests that propose, and catches up lazily. Per request it keeps the token history
and `synced`: positions [0, synced) hold draft KV this request's own passes wrote (the content of a shared
prefix block is the same for every request that holds it, so rewriting it is harmless; cached draft KV is
never trusted, so prefix caching and preemption need nothing special). Before proposing, one pass runs
positions [synced, P] (P = the new token's position): normally one or two tokens, because the last round's
draft steps already wrote P' + 1 .. with the drafts the target has now accepted. After a stretch without
speculation (off for a big batch, a long prompt) it is a prefill-like pass, capped at max_catchup tokens
per step. So when speculation is off, the draft costs nothing.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from tokenmill.layers.cpu_memory import zeroed_tensors
from tokenmill.spec_decode import DraftBatch, DraftRequest, Proposer
from tokenmill.models.flat_batch import block_table_array, flat_batch
from tokenmill.models.loader import load_model

logger = logging.getLogger("tokenmill")


class KVDrafter(Proposer):
    """Shared machinery of drafters that keep paged KV: cache tensors and the single-token draft loop."""
    needs_kv = True

    def __init__(self, config, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.block_size = config.cache.block_size
        self.device = torch.device(config.device)
        self.dtype = dtype
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.kv_caches: list[torch.Tensor] = []

    def kv_cache_shapes(self, num_blocks: int) -> list[tuple[int, ...]]:
        return [(2, self.num_kv_heads, num_blocks, self.block_size, self.head_dim)] * self.num_layers

    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim * elem

    def initialize_cache(self, num_blocks: int) -> None:
        # zeros (finite values under masked reads), as the target's cache: one allocation, touched as it fills
        self.kv_caches = zeroed_tensors(self.kv_cache_shapes(num_blocks), self.dtype, self.device)

    def _flat(self, tokens: list[list[int]], starts: list[int], block_ids: list[list[int]]):
        qlens = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
        ids = np.fromiter((x for t in tokens for x in t), dtype=np.int64, count=int(qlens.sum()))
        return flat_batch(ids, qlens, np.asarray(starts, dtype=np.int64), block_table_array(block_ids),
                          self.block_size, self.device)

    @staticmethod
    def _budget(r: DraftRequest, pos_of_first_input: int, max_model_len: int, bs: int) -> int:
        """Drafts r may get without writing past its blocks or the context: the j-th draft step writes
        position pos_of_first_input + j - 1 (j = 1 .. n - 1)."""
        room = min(len(r.block_ids) * bs, max_model_len) - pos_of_first_input
        return max(0, min(r.num_propose, room + 1))


class _State:
    __slots__ = ("hist", "synced", "spec")

    def __init__(self, hist: list[int]) -> None:
        self.hist = hist      # every token of the request so far (positions 0 .. len - 1)
        self.synced = 0       # positions [0, synced) hold valid draft KV
        self.spec = None      # (first position, count) the last round's draft steps wrote with its drafts


class DraftModelProposer(KVDrafter):
    wants_history = True

    def __init__(self, config, backend) -> None:
        spec, mc = config.speculative, config.model
        cfg = spec.draft_hf_config
        # A quantized draft (e.g. an int8 copy of the target itself): same tokenizer, a fraction of the bytes.
        self.model = load_model(spec.draft_model_dir, cfg, mc.torch_dtype, config.device, backend,
                                max_positions=mc.max_model_len, quantization=spec.quantization,
                                quantize_lm_head=mc.quantize_lm_head)
        attn = self.model.layers[0].self_attn
        super().__init__(config, len(self.model.layers), attn.num_kv_heads, attn.head_dim, mc.torch_dtype)
        self.max_catchup = max(config.scheduler.max_num_batched_tokens or 2048, 1)
        self.state: dict[str, _State] = {}

    def free(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.state.pop(rid, None)

    def _track(self, r: DraftRequest) -> _State:
        st = self.state.get(r.request_id)
        if r.new or st is None:
            st = self.state[r.request_id] = _State(list(r.history or []))
        if st.spec is not None:  # last round's draft steps wrote the drafts the target just verified
            first, count = st.spec
            if r.start_pos + 1 == first and st.synced == first:
                st.synced = first + min(r.num_accepted, count)
            st.spec = None
        del st.hist[r.start_pos:]
        st.hist.extend(r.computed)
        if r.sampled:
            st.hist.append(r.next_token)
        st.synced = min(st.synced, r.start_pos + len(r.computed))
        return st

    def propose(self, batch: DraftBatch) -> dict[str, list[int]]:
        limit = batch.max_model_len
        tokens, starts, blocks, props = [], [], [], []  # props: (request, state, P, drafts wanted) or None
        for r in batch.reqs:
            st = self._track(r)
            P = r.start_pos + len(r.computed)  # the new token's position
            if not (r.sampled and r.num_propose > 0) or P >= min(len(r.block_ids) * self.block_size, limit):
                continue  # no proposal (or no slot for the new token): the draft need not run now
            end = min(P + 1, st.synced + self.max_catchup)
            tokens.append(st.hist[st.synced:end])
            starts.append(st.synced)
            blocks.append(r.block_ids)
            st.synced = end
            props.append((r, st, P, self._budget(r, P + 1, limit, self.block_size)) if end == P + 1 else None)
        if not tokens:
            return {}
        input_ids, meta, qsl = self._flat(tokens, starts, blocks)
        hidden = self.model(input_ids, meta, self.kv_caches)

        # Requests that propose: the catch-up pass's last row scores draft 1.
        active = [(r, st, int(qsl[i + 1]) - 1, P, n) for i, (r, st, P, n) in
                  ((i, p) for i, p in enumerate(props) if p is not None) if n > 0]
        if not active:
            return {}
        cur = self.model.compute_logits(hidden[[row for _, _, row, _, _ in active]]).argmax(-1)
        drafts: dict[str, list[int]] = {r.request_id: [] for r, *_ in active}
        for _, st, _, P, n in active:
            st.spec = (P + 1, n - 1)
        for j in range(max(n for *_, n in active)):
            toks = cur.tolist()
            for (r, *_), t in zip(active, toks):
                drafts[r.request_id].append(t)
            keep = [i for i, a in enumerate(active) if a[4] > j + 1]
            if not keep:
                break
            if len(keep) < len(active):
                active = [active[i] for i in keep]
                cur = cur[keep]
            # Step j + 1: draft j + 1 enters at position P + j + 1.
            starts_a = np.asarray([P + j + 1 for *_, P, _ in active], dtype=np.int64)
            input_ids, meta, _ = flat_batch(cur.cpu().numpy(), np.ones(len(active), dtype=np.int64), starts_a,
                                            block_table_array([r.block_ids for r, *_ in active]),
                                            self.block_size, self.device)
            cur = self.model.compute_logits(self.model(input_ids, meta, self.kv_caches)).argmax(-1)
        return drafts
