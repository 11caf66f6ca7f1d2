"""Draft-model drafter: a smaller model with the target's tokenizer, its own paged KV cache over the target's
block ids, run for the whole batch: one catch-up pass, then k - 1 single-token steps.

Catch-up: the draft must hold KV for every position the target does. Last round it already wrote positions
P .. P + w - 1 with the tokens [new token, d_1 .. d_{w-1}] (P = the new token's position, w = drafts proposed);
if the target accepted m of them this step, those with correct tokens are P .. P + min(m, w - 1), so the
catch-up pass needs only the positions after that up to the next new token: one or two tokens per request.
Anything else (a prefill chunk, a request seen for the first time, resumed after preemption) runs over all of
the step's valid tokens. Proposals are greedy (one-hot q for the rejection sampler).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from tokenmill.spec_decode import DraftBatch, DraftRequest, Proposer
from tokenmill.worker.flat_batch import block_table_array, flat_batch

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
        shapes = self.kv_cache_shapes(num_blocks)
        nbytes = sum(int(np.prod(s)) for s in shapes) * torch.tensor([], dtype=self.dtype).element_size()
        # As the target's cache: a large CPU torch.empty is lazily zeroed by the kernel (finite values).
        alloc = torch.empty if self.device.type == "cpu" and nbytes >= 64 * 2**20 else torch.zeros
        self.kv_caches = [alloc(s, dtype=self.dtype, device=self.device) for s in shapes]

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


class DraftModelProposer(KVDrafter):
    def __init__(self, config, backend) -> None:
        from tokenmill.models.loader import load_model

        spec, mc = config.speculative, config.model
        cfg = spec.draft_hf_config
        # A quantized draft (e.g. an int8 copy of the target itself): same tokenizer, a fraction of the bytes.
        self.model = load_model(spec.draft_model_dir, cfg, mc.torch_dtype, config.device, backend,
                                max_positions=mc.max_model_len, quantization=spec.quantization)
        attn = self.model.layers[0].self_attn
        super().__init__(config, len(self.model.layers), attn.num_kv_heads, attn.head_dim, mc.torch_dtype)
        self.written: dict[str, tuple[int, int]] = {}  # rid -> (P, w): draft wrote P .. P + w - 1 last round

    def free(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.written.pop(rid, None)

    def propose(self, batch: DraftBatch) -> dict[str, list[int]]:
        tokens, starts, blocks, rows_of = [], [], [], []
        limit = batch.max_model_len
        for r in batch.reqs:
            P = r.start_pos + len(r.computed)
            # The new token's KV is written now only where its slot exists (lookahead allocated).
            with_new = r.sampled and P < min(len(r.block_ids) * self.block_size, limit)
            seq = r.computed + ([r.next_token] if with_new else [])
            start = r.start_pos
            prev = None if r.new else self.written.pop(r.request_id, None)
            if prev is not None and prev[0] == r.start_pos and r.num_spec < prev[1] + 1:
                skip = 1 + min(r.num_accepted, prev[1] - 1)  # positions P .. P + skip - 1 hold valid draft KV
                seq, start = seq[skip:], start + skip
            if not seq:
                continue
            tokens.append(seq)
            starts.append(start)
            blocks.append(r.block_ids)
            rows_of.append(r)
        if not tokens:
            return {}
        input_ids, meta, qsl = self._flat(tokens, starts, blocks)
        hidden = self.model(input_ids, meta, self.kv_caches)

        # Requests that propose: the catch-up pass's last row scores draft 1.
        active = []
        for i, r in enumerate(rows_of):
            P = r.start_pos + len(r.computed)
            if not (r.sampled and P < min(len(r.block_ids) * self.block_size, limit)):
                continue
            n = self._budget(r, P + 1, limit, self.block_size)
            self.written[r.request_id] = (P, max(n, 1))
            if n > 0:
                active.append((r, int(qsl[i + 1]) - 1, P, n))
        if not active:
            return {}
        logits = self.model.compute_logits(hidden[[row for _, row, _, _ in active]])
        cur = logits.argmax(-1)
        drafts = {r.request_id: [] for r, *_ in active}
        for j in range(max(n for *_, n in active)):
            toks = cur.tolist()
            for (r, _, _, _), t in zip(active, toks):
                drafts[r.request_id].append(t)
            keep = [i for i, (_, _, _, n) in enumerate(active) if n > j + 1]
            if not keep:
                break
            active = [active[i] for i in keep]
            cur = cur[keep] if len(keep) < len(toks) else cur
            # Step j + 1: input draft j + 1 at position P + j + 1.
            starts = np.asarray([P + j + 1 for _, _, P, _ in active], dtype=np.int64)
            input_ids, meta, _ = flat_batch(cur.numpy() if cur.device.type == "cpu" else cur.cpu().numpy(),
                                            np.ones(len(active), dtype=np.int64), starts,
                                            block_table_array([r.block_ids for r, *_ in active]),
                                            self.block_size, self.device)
            cur = self.model.compute_logits(self.model(input_ids, meta, self.kv_caches)).argmax(-1)
        return drafts
