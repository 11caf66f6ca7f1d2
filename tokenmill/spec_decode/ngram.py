"""N-gram (prompt lookup) drafter: find the longest recent earlier occurrence of the context's last n tokens
(prompt_lookup_max >= n >= prompt_lookup_min) in the request's prompt and output, propose what followed it:
at most k tokens and at most as many as the match reaches back (see propose_ngram).

Vectorised over the batch: histories are right-aligned in one [B, L] matrix (left padding -1, which matches
no token). eq_j[b, i] = (X[b, i] == j-th last token of row b); an n-gram ending at position e matches iff
eq_j[b, e - j] for j < n, built up one j at a time, so all n of all rows cost O(B * L * max_n) array work
and no per-token Python; the chosen match's full length is then one [B, k] comparison.
"""
from __future__ import annotations

import numpy as np

from tokenmill.spec_decode import DraftBatch, Proposer


class NgramProposer(Proposer):
    wants_history = True

    def __init__(self, min_n: int, max_n: int, max_model_len: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.capacity = max_model_len + 1
        self.tokens: dict[str, np.ndarray] = {}
        self.lengths: dict[str, int] = {}

    def _update(self, r) -> None:
        buf = self.tokens.get(r.request_id)
        if r.new or buf is None:
            buf = self.tokens[r.request_id] = np.empty(self.capacity, dtype=np.int64)
            hist = r.history or []
            buf[:len(hist)] = hist
        end = r.start_pos + len(r.computed)
        buf[r.start_pos:end] = r.computed
        if r.sampled:
            buf[end] = r.next_token
            end += 1
        self.lengths[r.request_id] = end

    def propose(self, batch: DraftBatch) -> dict[str, list[int]]:
        for r in batch.reqs:
            self._update(r)
        want = [r for r in batch.reqs if r.num_propose > 0 and r.sampled]
        if not want:
            return {}
        hists = [self.tokens[r.request_id][:self.lengths[r.request_id]] for r in want]
        return {r.request_id: d for r, d in zip(want, propose_ngram(hists, [r.num_propose for r in want],
                                                                     self.min_n, self.max_n)) if d}

    def free(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.tokens.pop(rid, None)
            self.lengths.pop(rid, None)


def propose_ngram(histories: list[np.ndarray], k: list[int], min_n: int, max_n: int) -> list[list[int]]:
    """For each history, the tokens that followed the latest earlier occurrence of its longest matching
    suffix (max_n down to min_n tokens); [] where nothing matches. At most k tokens, and at most as many as
    the match reaches back (counted past max_n): a 2-token match is weak evidence for a 5-token guess, a
    20-token one is strong, and on CPU each rejected draft costs ~15-30% of a decode step (docs/benchmarks.md).
    A continuation that runs into the present repeats with the match's period (a loop keeps looping)."""
    B = len(histories)
    L = max(len(h) for h in histories)
    X = np.full((B, L), -1, dtype=np.int64)
    for b, h in enumerate(histories):
        X[b, L - len(h):] = h
    found = np.full(B, -1, dtype=np.int64)      # end position e of the chosen match
    match = np.ones((B, L - 1), dtype=bool)      # candidate ends e in [0, L-2]: a continuation must exist
    for n in range(1, min(max_n, L - 1) + 1):  # an n-gram with a continuation needs n + 1 tokens
        # eq for the n-th last token, aligned so column e compares X[b, e - (n - 1)].
        tail = X[:, L - n][:, None]
        shifted = np.zeros((B, L - 1), dtype=bool)
        if n - 1 < L - 1:
            shifted[:, n - 1:] = X[:, :L - 1 - (n - 1)] == tail
        match &= shifted & (tail >= 0)
        if n >= min_n:
            any_m = match.any(1)
            last = L - 2 - np.argmax(match[:, ::-1], axis=1)
            found = np.where(any_m, last, found)  # longer n overwrites shorter
    num = np.minimum(np.asarray(k), _match_length(X, found, max(k, default=0)))
    out = []
    for b in range(B):
        e, p = found[b], L - 1 - found[b]        # p: the match's distance from the end (its period)
        out.append(X[b, e + 1 + np.arange(num[b]) % p].tolist() if e >= 0 else [])
    return out


def _match_length(X: np.ndarray, ends: np.ndarray, cap: int) -> np.ndarray:
    """How many tokens (up to cap) before and at each row's end e equal the row's last tokens (0 where e < 0)."""
    j = np.arange(min(cap, X.shape[1]))
    src = ends[:, None] - j[None, :]                                  # X[b, e - j] against X[b, L - 1 - j]
    last = X[:, X.shape[1] - 1 - j]
    eq = (src >= 0) & (np.take_along_axis(X, np.maximum(src, 0), 1) == last) & (last >= 0)
    return np.cumprod(eq, axis=1).sum(1) * (ends >= 0)
