"""A GGUF's weights as the engine serves them natively (`--gguf-weights native`): each tensor's real bytes in
its own ggml type (blocks with their scales: Q4_K 4.5 bits per weight, Q6_K 6.5625, Q8_0 8.5, norms F32).

The tensors are the ones the engine's loader hands the model (models/gguf.GgufWeights: rope_freqs is not
loaded), sized by gguf-py's GGML_QUANT_SIZES. Only the header is read; nothing is dequantized or written.
"""
from __future__ import annotations

from dataclasses import dataclass

EMBEDDING = "model.embed_tokens.weight"
# Row-parallel layers: tensor parallel splits their input (block) dimension. attention output, MLP down (dense,
# Qwen-MoE and Mixtral experts)
_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight", ".w2.weight")


@dataclass(frozen=True)
class GgufBytes:
    path: str
    total: int                  # bytes of every weight tensor the engine loads
    elements: int               # their weights
    embedding: int              # the token embedding's bytes (a tied LM head is these same blocks)
    embedding_rows: int
    experts: int                # the routed experts' bytes, all stacks together
    by_type: tuple[tuple[str, int, int], ...]  # (ggml type, weights, bytes), most weights first
    row_parallel_types: tuple[str, ...] = ()   # the types of the row-parallel layers' weights

    @property
    def bits(self) -> float:
        return 8 * self.total / self.elements

    @property
    def embedding_row(self) -> float:
        """Bytes of one token's embedding row: what a lookup reads."""
        return self.embedding / self.embedding_rows

    def describe(self) -> str:
        """e.g. '4.85 bits/weight (Q4_K 71%, Q6_K 24%, F32 0.1%)': shares of the weights, not of the bytes."""
        shares = ", ".join(f"{name} {_share(n / self.elements)}" for name, n, _ in self.by_type)
        return f"{self.bits:.2f} bits/weight ({shares})"

    def as_dict(self) -> dict:
        return {"bits_per_weight": self.bits, "bytes": self.total, "weights": self.elements,
                "embedding_bytes": self.embedding, "expert_bytes": self.experts,
                "types": {name: {"weights": n, "bytes": b} for name, n, b in self.by_type}}


    def cut_blocks(self, widths: tuple[int, ...]) -> list[str]:
        """Types of the row-parallel weights whose blocks a rank's share of their input, `widths` (one per
        layer kind), does not hold whole: the engine keeps such shards as float32 (models/gguf.BlockTensor)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        return [name for name in self.row_parallel_types
                if any(w % GGML_QUANT_SIZES[GGMLQuantizationType[name]][0] for w in widths)]


def _share(x: float) -> str:
    return f"{x:.0%}" if x >= 0.01 else f"{x:.1%}" if x >= 0.001 else "<0.1%"


def tally(path: str, entries) -> GgufBytes:
    """Tally a GGUF's tensors as the engine loads them: `entries`, the loader's (models/gguf.GgufWeights; the
    caller reads them, so that this leaf imports no model code)."""
    types: dict[str, list[int]] = {}
    row_types: set[str] = set()
    total = elements = embedding = rows = experts = 0
    for entry in entries:
        t = entry.tensor
        count, nbytes = _size(t.tensor_type, entry.shape)  # an expert stack is listed once per expert
        slot = types.setdefault(t.tensor_type.name, [0, 0])
        slot[0] += count
        slot[1] += nbytes
        total, elements = total + nbytes, elements + count
        if entry.hf_name == EMBEDDING:
            embedding, rows = nbytes, entry.shape[0]
        if entry.expert is not None:
            experts += nbytes
        if entry.hf_name.endswith(_ROW_PARALLEL):
            row_types.add(t.tensor_type.name)
    if not elements or not embedding:
        raise ValueError(f"{path}: no weights or no token embedding in the GGUF file")
    by_type = tuple(sorted(((k, v[0], v[1]) for k, v in types.items()), key=lambda x: -x[1]))
    return GgufBytes(path, total, elements, embedding, rows, experts, by_type, tuple(sorted(row_types)))


def _size(kind, shape: tuple) -> tuple[int, int]:
    """(weights, bytes) of a tensor of ggml type `kind` and `shape`: whole blocks of GGML_QUANT_SIZES."""
    from gguf import GGML_QUANT_SIZES

    values, block_bytes = GGML_QUANT_SIZES[kind]
    count = 1
    for d in shape:
        count *= int(d)
    return count, count // values * block_bytes
