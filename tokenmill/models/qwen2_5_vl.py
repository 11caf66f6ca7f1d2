"""Qwen2.5-VL (HF `Qwen2_5_VLForConditionalGeneration`): a vision transformer whose merged patches replace the
prompt's `<|image_pad|>` tokens, and a Qwen2 text decoder (llama.py's pieces) with M-RoPE. Semantics follow
transformers' modeling_qwen2_5_vl.py:

- The vision tower embeds each 14x14 (x2 frames) patch with a linear map (HF's stride = kernel Conv3d), runs
  `depth` pre-norm blocks (RMSNorm, bidirectional attention with a 2-D rope over the patch's (h, w), a gated
  MLP with biases) and merges each 2x2 block of patches into one text-width token (RMSNorm, MLP with GELU).
  Patches arrive in merge-block order (the processor's patchify). Blocks not in `fullatt_block_indexes`
  attend within windows of `window_size` pixels: the merged units are reordered window by window (window_order)
  so each window is a contiguous run, and put back in order after the merger.
- The text decoder is Qwen2's (q/k/v biases) with M-RoPE (layers/rotary.MRotaryEmbedding): a token's position
  has three rows (temporal, height, width). Text tokens have all three equal; an image's tokens get
  (start, start + row, start + column) of their merged patch, and the text after an image continues from the
  largest of those + 1 (mrope_positions). Decode positions are the token index plus the prompt's delta.
- Images are encoded once per request by the worker (worker/multimodal.py) and their rows scattered over the
  placeholder tokens' embeddings before the first layer.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.attention.base import AttentionBackend, AttentionMetadata
from tokenmill.layers.attention.bidirectional import bidirectional_attention
from tokenmill.layers.linear import materialize
from tokenmill.layers.rotary import MRotaryEmbedding, RotaryEmbedding
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.step.multimodal import ImageInput, patch_values


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = {"silu": F.silu, "gelu": F.gelu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Sequence[int]) -> torch.Tensor:
        S = x.shape[0]
        q, k, v = self.qkv(x).view(S, 3, self.num_heads, self.head_dim).unbind(1)
        c, s = cos[:, None], sin[:, None]  # the rotation in float32, as HF does
        q = (q.float() * c + _rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(x.dtype)
        return self.proj(bidirectional_attention(q, k, v, segments, self.head_dim ** -0.5).reshape(S, -1))


class VisionBlock(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.norm1, self.norm2 = VisionRMSNorm(vc.hidden_size), VisionRMSNorm(vc.hidden_size)
        self.attn = VisionAttention(vc.hidden_size, vc.num_heads)
        self.mlp = VisionMLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Sequence[int]) -> torch.Tensor:
        """x [S, E]; cos/sin [S, head_dim] (float32); segments: attention runs within each [s_i, s_i+1)."""
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """HF's Conv3d with stride = kernel is a linear map of each flattened patch (loaded reshaped)."""

    def __init__(self, patch_dim: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(patch_dim, dim, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels.to(self.proj.weight.dtype))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.ln_q = VisionRMSNorm(dim)
        self.width = dim * merge * merge
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTransformer(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.merge, self.patch, self.window = vc.spatial_merge_size, vc.patch_size, vc.window_size
        self.full_blocks = set(vc.fullatt_block_indexes)
        patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        self.patch_embed = PatchEmbed(patch_dim, vc.hidden_size)
        head_dim = vc.hidden_size // vc.num_heads
        theta = (getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float) / (head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / theta ** quarter, persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc.depth))
        self.merger = PatchMerger(vc.out_hidden_size, vc.hidden_size, vc.spatial_merge_size)

    def forward(self, pixels: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
        """One image's patches [t*h*w, C*T*p*p] (merge-block order) -> its tokens [t*h*w / merge^2, out]."""
        t, h, w = grid
        unit = self.merge ** 2
        order, windows = window_order(grid, self.merge, self.window // self.merge // self.patch)
        x = self.patch_embed(pixels)
        x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)
        cos, sin = self._rope(t, h, w, order)
        frames = [i * h * w for i in range(t + 1)]  # full attention: within each frame
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.full_blocks else windows)
        return self.merger(x)[torch.argsort(order)]

    def _rope(self, t: int, h: int, w: int, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.merge
        hh = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
        ww = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        # merge-block order: (block row, block column, row in block, column in block)
        hpos, wpos = (a.permute(0, 2, 1, 3).reshape(-1).repeat(t) for a in (hh, ww))
        freqs = torch.cat([hpos[:, None] * self.inv_freq, wpos[:, None] * self.inv_freq], -1)  # [S, D/2]
        freqs = freqs.view(-1, m * m, freqs.shape[-1])[order].flatten(0, 1)
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos(), emb.sin()


def window_order(grid: Sequence[int], merge: int, size: int) -> tuple[torch.Tensor, list[int]]:
    """The merged units (t, h/merge, w/merge) reordered window by window (windows of size x size units tiling
    each frame from its top left, row-major; units row-major inside), and the patch offsets where each window
    starts, plus the end (a window of n units is n * merge^2 patches)."""
    t, gh, gw = grid[0], grid[1] // merge, grid[2] // merge
    units = torch.arange(t * gh * gw).view(t, gh, gw)
    order, bounds = [], [0]
    for f in range(t):
        for r in range(0, gh, size):
            for c in range(0, gw, size):
                win = units[f, r:r + size, c:c + size].reshape(-1)
                order.append(win)
                bounds.append(bounds[-1] + win.numel() * merge * merge)
    return torch.cat(order), bounds


def mrope_positions(prompt_len: int, images: Sequence[ImageInput], merge: int) -> tuple[np.ndarray, int]:
    """The prompt's M-RoPE positions [3, prompt_len] and the delta a later token adds to its index: text runs
    on from the last position + 1; an image's tokens are (start, start + row, start + column) of their merged
    patch (frames at start + frame index), and the text after it starts at start + max(rows, columns)."""
    pos = np.empty((3, prompt_len), dtype=np.int64)
    cursor, nxt = 0, 0  # the next prompt index to place, and the next text position
    for img in sorted(images, key=lambda i: i.offset):
        n_text = img.offset - cursor
        pos[:, cursor:img.offset] = nxt + np.arange(n_text)
        nxt += n_text
        t, h, w = img.grid_thw[0], img.grid_thw[1] // merge, img.grid_thw[2] // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        end = img.offset + img.num_tokens
        pos[:, img.offset:end] = nxt + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        cursor, nxt = end, nxt + max(h, w, t)
    pos[:, cursor:] = nxt + np.arange(prompt_len - cursor)
    return pos, int(pos.max()) + 1 - prompt_len if prompt_len else 0


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    # models/cpu_stack.py: decoder_stack.c has one 1-D rope table per layer
    cpu_stack_unsupported = ("Qwen2.5-VL's M-RoPE (three position rows per token) is not in the C decoder stack; "
                             "it runs layer by layer")

    def __init__(self, config, dtype: torch.dtype, backend: AttentionBackend, max_positions: int,
                 layer_range: Optional[tuple[int, int]] = None) -> None:
        super().__init__(config, dtype, backend, max_positions, layer_range)
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        # the first pipeline stage embeds the prompt, so it runs the vision tower
        self.visual = VisionTransformer(config.vision_config).to(dtype) if self.embed_tokens is not None else None

    def make_rotary(self, config, max_positions: int, layer_type: Optional[str]) -> RotaryEmbedding:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return MRotaryEmbedding(config, head_dim, max_positions)

    def encode_image(self, image: ImageInput) -> torch.Tensor:
        """The image's tokens [num_tokens, hidden] in the model dtype."""
        vc = self.config.vision_config
        pixels = torch.from_numpy(patch_values(image, vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size))
        return self.visual(pixels.to(self.embed_tokens.weight.device), image.grid_thw).to(self.dtype)

    def mrope_positions(self, prompt_len: int, images: Sequence[ImageInput]) -> tuple[np.ndarray, int]:
        return mrope_positions(prompt_len, images, self.spatial_merge_size)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor],
                intermediate=None, image_rows: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        """image_rows: (flat-batch rows, their image tokens [rows, hidden]) to put in place of the embeddings."""
        if image_rows is None or self.embed_tokens is None:
            return super().forward(input_ids, meta, kv_caches, intermediate)
        x = self.embed(input_ids).index_copy(0, *image_rows)
        return self.run_layers(x, None, meta, kv_caches)

    def checkpoint_target(self, name: str) -> Optional[tuple[str, int]]:
        # transformers 5 saves model.language_model.* and model.visual.*; Qwen's checkpoints model.* and visual.*
        name = name.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
        if name.startswith("visual."):
            return (name, 0) if self.visual is not None else None
        return super().checkpoint_target(name)

    @staticmethod
    def _load_param(name: str, param: nn.Parameter, module: nn.Module, tensor, shard: int) -> None:
        if name.endswith("patch_embed.proj.weight"):  # the Conv3d kernel [E, C, T, p, p] as a linear map
            tensor = materialize(tensor).reshape(tensor.shape[0], -1)
        LlamaForCausalLM._load_param(name, param, module, tensor, shard)
