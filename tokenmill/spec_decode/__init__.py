"""Speculative decoding: drafters propose k tokens per request, the model runner verifies them all in the
step's one flat forward pass, the rejection sampler keeps the target distribution exactly.

Data flow per engine step (DESIGN.md §1, §3):
  scheduler  puts a request's pending drafts after its last token (k + 1 query tokens), allocates their slots
             (plus `k` lookahead slots a KV-keeping drafter writes ahead), and picks this step's k
             (SpecController: disable_by_batch_size, adaptive).
  runner     scores all k + 1 positions, rejection-samples, then hands the drafter a DraftBatch: what each
             request now has (valid tokens, the new token, target hidden states); the drafter proposes
             drafts for the next step.
  scheduler  appends the accepted tokens (stopping at stop tokens / max_tokens), rolls back the rejected
             drafts' slots (num_computed_tokens), stores the new drafts and the acceptance counters.

KV-keeping drafters (draft_model, eagle, eagle3) share the target's block ids: their cache has the same
number of blocks and a token's slot is the same in both, so they need no block accounting of their own.
EAGLE heads run over every position the target computes (they need the target's hidden states, which exist
only in that step), so their KV is valid wherever the target's is. A draft model instead catches up lazily,
only for requests about to propose, from its own token history (see draft_model.py), so it costs nothing
while speculation is off.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class DraftRequest:
    """One request's state after this step's forward pass and sampling, as a drafter sees it."""
    request_id: str
    start_pos: int              # position of computed[0]
    computed: list[int]         # tokens that now have valid target KV, from start_pos (rejected drafts removed)
    q0: int                     # row of computed[0] in the step's flat hidden states
    next_token: Optional[int]   # token at start_pos + len(computed): the new sample, or the next prompt token
    sampled: bool               # next_token was sampled this step (no KV anywhere yet)
    block_ids: list[int]        # the target's (a KV-keeping drafter runs with one KV group: step/kv_groups.py)
    num_propose: int            # drafts wanted for the next step (0: only keep the drafter's state in sync)
    num_spec: int = 0           # drafts verified this step
    num_accepted: int = 0
    new: bool = False           # first step since (re)admission: forget per-request state
    history: Optional[list[int]] = None  # with `new`: all tokens before start_pos (for history drafters)


@dataclass
class DraftBatch:
    reqs: list[DraftRequest]
    hidden: Optional[torch.Tensor] = None       # [T, H] target final hidden states of the step
    aux_hidden: Optional[torch.Tensor] = None   # [T, n*H] fused intermediate states (eagle3)
    max_model_len: int = 0


class Proposer:
    """Drafter interface. propose() returns request id -> draft token ids (at most num_propose each)."""
    needs_kv = False        # keeps a paged KV cache over the target's block ids
    wants_history = False   # needs every request's full token history (given on its first step)
    aux_layers: tuple[int, ...] = ()  # target layers whose input hidden states the drafter fuses

    def kv_cache_shapes(self, num_blocks: int) -> list[tuple[int, ...]]:
        return []

    def bytes_per_block(self) -> int:
        return 0

    def initialize_cache(self, num_blocks: int) -> None:
        pass

    def propose(self, batch: DraftBatch) -> dict[str, list[int]]:
        raise NotImplementedError

    def free(self, request_ids: list[str]) -> None:
        pass


def make_proposer(config, target_model, backend) -> Proposer:
    spec = config.speculative
    if spec.method == "ngram":
        from tokenmill.spec_decode.ngram import NgramProposer  # cycle at import time: it imports this package

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, config.model.max_model_len)
    if spec.method == "draft_model":
        from tokenmill.spec_decode.draft_model import DraftModelProposer  # cycle at import time, as ngram

        return DraftModelProposer(config, backend)
    from tokenmill.spec_decode.eagle import EagleProposer  # cycle at import time, as ngram

    return EagleProposer(config, target_model, backend)
