"""The worker's half of image input (a VLM: the model has encode_image and mrope_positions): each request's
M-RoPE positions, computed once from its prompt's images, and the encoder cache.

An image is encoded when the first chunk that reaches any of its placeholder tokens runs, whole, and its
tokens are kept until a chunk has consumed the last of them: a prompt prefilled in chunks, or resumed after a
prefix-cache hit that ends inside the image, encodes each image once.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from tokenmill.step import ScheduledRequest
from tokenmill.worker.request_states import RequestStates


class MultimodalInputs:
    def __init__(self, model) -> None:
        self.model = model
        self.positions: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (prompt's [3, L], decode delta)
        self.features: dict[tuple[str, int], torch.Tensor] = {}  # (request id, image index) -> its tokens
        self.num_encoded = 0  # images the vision tower has run (a test checks: once per image per request)
        self.encoded_tokens = 0  # their tokens (the scheduler's encoder budget bounds a step's)

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self.positions.pop(rid, None)
        gone = set(request_ids)
        for key in [k for k in self.features if k[0] in gone]:
            del self.features[key]

    def rope_positions(self, reqs: list[ScheduledRequest], states: RequestStates) -> np.ndarray:
        """[3, T] for the step's tokens: the prompt's table, then index + delta for generated tokens."""
        out = []
        for r in reqs:
            st = states[r.request_id]
            table, delta = self._table(r.request_id, st)
            idx = np.arange(r.start_pos, r.start_pos + len(r.token_ids))
            pos = np.broadcast_to(idx + delta, (3, len(idx))).copy()
            in_prompt = idx < table.shape[1]
            pos[:, in_prompt] = table[:, idx[in_prompt]]
            out.append(pos)
        return np.concatenate(out, axis=1)

    def _table(self, rid: str, st) -> tuple[np.ndarray, int]:
        found = self.positions.get(rid)
        if found is None:
            found = self.positions[rid] = self.model.mrope_positions(st.num_prompt_tokens, st.mm_inputs)
        return found

    def image_rows(self, reqs: list[ScheduledRequest], states: RequestStates,
                   qsl: np.ndarray) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(flat-batch rows, image tokens for them) of every placeholder token this step runs; None if none."""
        rows, feats = [], []
        for i, r in enumerate(reqs):
            start, end = r.start_pos, r.start_pos + len(r.token_ids)
            for j, img in enumerate(states[r.request_id].mm_inputs):
                lo, hi = max(img.offset, start), min(img.end, end)
                if lo >= hi:
                    continue
                key = (r.request_id, j)
                tokens = self.features.get(key)
                if tokens is None:
                    tokens = self.features[key] = self.model.encode_image(img)
                    self.num_encoded += 1
                    self.encoded_tokens += img.num_tokens
                rows.append(torch.arange(lo - start, hi - start) + int(qsl[i]))
                feats.append(tokens[lo - img.offset:hi - img.offset])
                if hi == img.end:  # consumed: a later chunk never reads it (a re-run after a failure re-encodes)
                    del self.features[key]
        if not rows:
            return None
        return torch.cat(rows).to(feats[0].device), torch.cat(feats)
