"""Attention over the paged KV cache. base.py holds the interface (AttentionBackend, AttentionMetadata); the
backends implement it, and get_attention_backend picks one for a device, so that the interface never imports
its implementations."""
from __future__ import annotations

from tokenmill.layers.attention.base import AttentionBackend
from tokenmill.layers.attention.cpu import PagedAttentionBackend


def get_attention_backend(device: str) -> AttentionBackend:
    # SDPA over the paged cache serves both devices until a dedicated CUDA kernel lands.
    return PagedAttentionBackend(device)
