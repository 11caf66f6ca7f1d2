"""EAGLE and EAGLE-3 draft heads (the published checkpoint layouts) for Llama-family targets.

Both run one decoder layer at the target's positions, with their own one-layer paged KV cache over the
target's block ids. The head's input at position p is the embedding of token p + 1 together with a hidden
state for position p, so it predicts token p + 2:

- EAGLE ("eagle"): fc(cat(embed, h)) -> decoder layer (no input norm on its only layer) -> the target's LM head.
  h is the target's final (normed) hidden state at p; in later draft steps, the head's own previous output.
  Checkpoint: fc.weight [H, 2H] (+ fc.bias), layers.0.{self_attn,mlp,post_attention_layernorm}.*.
- EAGLE-3 ("eagle3"): h = fc(cat(three target hidden states)) for target positions (the residual stream
  entering a low, a middle and a high layer), the head's own pre-norm output in later steps; the layer's
  attention reads cat(input_layernorm(embed), hidden_norm(h)) [2H]; logits = lm_head(norm(out)) over its own
  draft vocabulary, mapped to target ids by d2t (target = draft + d2t[draft]).
  Checkpoint: fc.weight [H, 3H], midlayer.{hidden_norm,input_layernorm,self_attn,mlp,post_attention_layernorm}.*,
  norm.weight, lm_head.weight [Vd, H], d2t [Vd] (t2d is not needed).
Where a checkpoint omits embed_tokens / lm_head, the target's are used.

Each step: one pass over every position the target computed validly (its hidden states are only available
now), then k - 1 single-token steps feeding the head its own output. Proposals are greedy.
"""
from __future__ import annotations

import glob
import logging
import os
from typing import Iterator

import numpy as np
import torch
from torch import nn

from tokenmill.layers import cpu_linear
from tokenmill.layers.linear import ColumnParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.llama import MLP, Attention
from tokenmill.spec_decode import DraftBatch
from tokenmill.spec_decode.draft_model import KVDrafter
from tokenmill.models.flat_batch import block_table_array, flat_batch

logger = logging.getLogger("tokenmill")


def _checkpoint_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors import safe_open

        for f in files:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        return
    files = sorted(glob.glob(os.path.join(path, "*.bin")))
    if not files:
        raise ValueError(f"no *.safetensors or *.bin weights in the EAGLE head directory {path}")
    for f in files:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's usual picks (low, middle, high), clamped into small models."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


class EagleHead(nn.Module):
    def __init__(self, cfg, eagle3: bool, num_aux: int, keys: set[str], dtype: torch.dtype, backend,
                 max_positions: int) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.eagle3 = eagle3
        head_dim = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
        rotary = RotaryEmbedding(cfg, head_dim, max_positions)
        fc_in = num_aux * H if eagle3 else 2 * H
        self.fc = nn.Linear(fc_in, H, bias="fc.bias" in keys, dtype=dtype)
        self.self_attn = Attention(cfg, 0, dtype, backend, rotary)
        if eagle3:  # attention reads cat(normed embedding, normed hidden)
            a = self.self_attn
            self.self_attn.qkv_proj = ColumnParallelLinear(
                2 * H, [cfg.num_attention_heads * a.head_dim, cfg.num_key_value_heads * a.head_dim,
                        cfg.num_key_value_heads * a.head_dim], bias=a.qkv_proj.bias is not None, dtype=dtype)
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps, dtype)
            self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype)
            self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        else:
            self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype) if "input_layernorm.weight" in keys else None
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype)
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, H, dtype=dtype) if "embed_tokens.weight" in keys else None)
        draft_vocab = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
        self.lm_head = nn.Linear(H, draft_vocab, bias=False, dtype=dtype) if "lm_head.weight" in keys else None
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long) if "d2t" in keys else None)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, meta, kv_cache: torch.Tensor,
                fuse: bool) -> torch.Tensor:
        if self.eagle3:
            if fuse:
                hidden = self.fc(hidden)
            residual = hidden
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)
        else:
            x = residual = self.fc(torch.cat([embeds, hidden], -1))
            if self.input_layernorm is not None:
                x = self.input_layernorm(x)
        x = self.self_attn(x, meta, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) + residual


_RENAME = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def load_eagle_head(path: str, cfg, eagle3: bool, num_aux: int, dtype, device, backend, max_positions) -> EagleHead:
    tensors = {}
    for name, t in _checkpoint_tensors(path):
        for prefix in ("model.", "midlayer.", "layers.0."):
            if name.startswith(prefix):
                name = name[len(prefix):]
        tensors[name] = t
    with torch.device(device):
        head = EagleHead(cfg, eagle3, num_aux, set(tensors), dtype, backend, max_positions)
    params = dict(head.named_parameters())
    buffers = dict(head.named_buffers())
    loaded = set()
    for name, t in tensors.items():
        if name == "t2d":
            continue
        if name == "d2t":
            head.d2t.copy_(t.long())
            continue
        parts = name.split(".")
        shard = None
        if len(parts) >= 2 and parts[-2] in _RENAME:
            parts[-2], shard = _RENAME[parts[-2]]
        target = ".".join(parts)
        if target not in params:
            if target in buffers or "rotary_emb" in target:
                continue
            raise ValueError(f"EAGLE head tensor {name!r} in {path} has no place in the "
                             f"{'EAGLE-3' if eagle3 else 'EAGLE'} layout")
        module = head.get_submodule(".".join(parts[:-1]))
        if shard is not None:
            module.load_shard(params[target], t, shard)
        else:
            if params[target].shape != t.shape:
                raise ValueError(f"EAGLE head tensor {name!r} has shape {tuple(t.shape)}, "
                                 f"expected {tuple(params[target].shape)}")
            params[target].data.copy_(t)
        loaded.add(target)
    missing = sorted(n for n in params if n not in loaded)
    if missing:
        raise ValueError(f"EAGLE head weights missing from {path}: {', '.join(missing[:4])}")
    return head.eval()


class EagleProposer(KVDrafter):
    def __init__(self, config, target_model, backend) -> None:
        spec, mc = config.speculative, config.model
        self.eagle3 = spec.method == "eagle3"
        cfg = spec.draft_hf_config
        n_target = len(target_model.layers)
        layers = (spec.eagle_aux_hidden_state_layer_ids or getattr(cfg, "eagle_aux_hidden_state_layer_ids", None)
                  or default_aux_layers(n_target))
        if self.eagle3 and not all(0 <= i < n_target for i in layers):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(layers)} must lie in 0..{n_target - 1}")
        self.aux_layers = tuple(layers) if self.eagle3 else ()
        self.head = load_eagle_head(spec.draft_model_dir, cfg, self.eagle3, len(self.aux_layers), mc.torch_dtype,
                                    config.device, backend, mc.max_model_len)
        self.target = target_model
        attn = self.head.self_attn
        super().__init__(config, 1, attn.num_kv_heads, attn.head_dim, mc.torch_dtype)

    # -- head pieces, falling back to the target's --------------------------------------------
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        emb = self.head.embed_tokens if self.head.embed_tokens is not None else self.target.embed_tokens
        return emb(ids)

    def _next_tokens(self, out: torch.Tensor) -> torch.Tensor:
        h = self.head.norm(out) if self.head.eagle3 else out
        if self.head.lm_head is None:
            return self.target.compute_logits(h).argmax(-1)
        draft = cpu_linear.linear(h, self.head.lm_head.weight).argmax(-1)
        return draft + self.head.d2t[draft] if self.head.d2t is not None else draft

    def propose(self, batch: DraftBatch) -> dict[str, list[int]]:
        limit = batch.max_model_len
        tokens, starts, blocks, rows, reqs = [], [], [], [], []
        for r in batch.reqs:
            n = len(r.computed) - (r.next_token is None)  # position p needs token p + 1
            if n <= 0:
                continue
            tokens.append(r.computed[1:n] + ([r.next_token] if r.next_token is not None else []))
            starts.append(r.start_pos)
            blocks.append(r.block_ids)
            rows.extend(range(r.q0, r.q0 + n))
            reqs.append(r)
        if not tokens:
            return {}
        qlens = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
        ids = np.fromiter((x for t in tokens for x in t), dtype=np.int64, count=int(qlens.sum()))
        input_ids, meta, qsl = flat_batch(ids, qlens, np.asarray(starts, dtype=np.int64), block_table_array(blocks),
                                          self.block_size, self.device)
        src = batch.aux_hidden if self.eagle3 else batch.hidden
        rows_t = torch.as_tensor(rows, device=src.device)
        out = self.head(self._embed(input_ids), src.index_select(0, rows_t), meta, self.kv_caches[0], fuse=True)

        active = []  # (request, row of its last output, position P of its new token, drafts wanted)
        for i, r in enumerate(reqs):
            if not r.sampled or r.num_propose <= 0:
                continue
            P = r.start_pos + len(r.computed)
            n = self._budget(r, P, limit, self.block_size)
            if n > 0:
                active.append((r, int(qsl[i + 1]) - 1, P, n))
        if not active:
            return {}
        h = out[[row for _, row, _, _ in active]]
        cur = self._next_tokens(h)
        drafts = {r.request_id: [] for r, *_ in active}
        for j in range(max(n for *_, n in active)):
            toks = cur.tolist()
            for (r, *_), t in zip(active, toks):
                drafts[r.request_id].append(t)
            keep = [i for i, a in enumerate(active) if a[3] > j + 1]
            if not keep:
                break
            if len(keep) < len(active):
                active = [active[i] for i in keep]
                cur, h = cur[keep], h[keep]
            # Draft j + 1 enters at position P + j with the head's own output as its hidden state.
            starts_a = np.asarray([P + j for _, _, P, _ in active], dtype=np.int64)
            input_ids, meta, _ = flat_batch(cur.cpu().numpy(), np.ones(len(active), dtype=np.int64), starts_a,
                                            block_table_array([r.block_ids for r, *_ in active]),
                                            self.block_size, self.device)
            h = self.head(self._embed(input_ids), h, meta, self.kv_caches[0], fuse=False)
            cur = self._next_tokens(h)
        return drafts
