"""When to speculate and how far (the scheduler asks once per step), and the acceptance counters.

Speculation and large batches compete for the same compute: verifying k drafts for B requests runs
B(k + 1) tokens, which costs about what B decodes cost only while the step is memory-bound. Whether it
pays depends on acceptance, on the drafter's cost and on how the step cost grows with tokens on this
machine, so the adaptive mode measures the outcome of all three rather than modelling them:

- disable_by_batch_size N: no speculation in a step with N or more running requests.
- adaptive: for each batch-size bucket (1, 2-3, 4-7, ...) and each k in 0..k_max, the measured wall time
  of a decode step at that k per request (verification and drafting included; decayed averages), and, over
  all requests, the recent per-token acceptance a and the fraction phi of draft slots drafters fill. The
  controller runs the k with the best predicted rate, tokens per request-step over its measured cost:
      (1 + phi * a (1 - a^k) / (1 - a)) / cost(bucket, k)
  Acceptance changes along a text much faster than costs do, so it is not left to the per-k measurements.
  Every EXPLORE_EVERY steps (sooner while one is unmeasured; less and less often while trials confirm the
  best k) a TRIAL_STEPS-step trial runs at a neighbour of the best k or at 0; its first step only proposes
  at the new k and is not measured. A new bucket starts
  from the nearest measured bucket's best k (the very first from the middle of 0..k_max). When drafts stop
  being accepted, or the batch makes verification compute-bound, k = 0 wins: speculation is off but for
  the trials (a draft model does not run at all then: it catches up lazily).
"""
from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.8           # weight of the past in the cost averages, per measured step
ACC_DECAY = 0.95      # ... in the acceptance sums, per verification round
EXPLORE_EVERY = 24   # steps between trials; doubles (to EXPLORE_MAX) while trials keep confirming the best k
EXPLORE_MAX = 384
TRIAL_STEPS = 4


@dataclass
class SpecDecodeCounters:
    """Cumulative acceptance counters (what /metrics reports)."""
    num_drafts: int = 0             # verification rounds: requests x steps with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_evaluated_tokens: int = 0   # draft positions whose accept test ran (accepted + first rejected)
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted_per_pos[j]: drafts at j accepted
    drafted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_spec: int, num_accepted: int) -> None:
        if num_spec <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_spec
        self.num_accepted_tokens += num_accepted
        self.num_evaluated_tokens += min(num_accepted + 1, num_spec)
        if len(self.drafted_per_pos) < num_spec:
            grow = num_spec - len(self.drafted_per_pos)
            self.drafted_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for j in range(num_spec):
            self.drafted_per_pos[j] += 1
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def per_token_acceptance(self) -> float:
        """P(draft accepted | all before it were): the `a` of the speedup formula."""
        return self.num_accepted_tokens / self.num_evaluated_tokens if self.num_evaluated_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification round (accepted drafts + the one the target adds)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecController:
    def __init__(self, k_max: int, disable_by_batch_size=None, adaptive: bool = False) -> None:
        self.k_max = k_max
        self.disable_by_batch_size = disable_by_batch_size
        self.adaptive = adaptive
        self.counters = SpecDecodeCounters()
        self._cost: dict[tuple[int, int], list[float]] = {}  # (bucket, k) -> [decayed seconds/request, weight]
        self._acc, self._evaluated = 0.6 * 4, 4.0              # decayed; prior a = 0.6
        self._fill, self._fill_w = 1.0, 1.0
        self.last_k = k_max
        self._prev_k = None
        self._steps = 0
        self._last_trial = 0
        self._trial_k = 0
        self._trial_left = 0
        self._trial_from = None   # the best k when the last trial started
        self._interval = EXPLORE_EVERY
        self._rr = 0

    @staticmethod
    def bucket(batch_size: int) -> int:
        return batch_size.bit_length()

    @property
    def acceptance(self) -> float:
        return min(self._acc / self._evaluated, 0.999)

    def cost(self, bucket: int, k: int):
        c = self._cost.get((bucket, k))
        return c[0] / c[1] if c else None

    def predicted_rate(self, bucket: int, k: int):
        """Tokens per request per second at k, from the measured cost and the current acceptance."""
        cost = self.cost(bucket, k)
        if cost is None:
            return None
        a, phi = self.acceptance, min(self._fill / self._fill_w, 1.0)
        return (1.0 + phi * a * (1.0 - a ** k) / (1.0 - a)) / cost

    # -- decisions -------------------------------------------------------------------------
    def choose_k(self, batch_size: int) -> int:
        if self.k_max <= 0 or batch_size <= 0:
            k = 0
        elif self.disable_by_batch_size is not None and batch_size >= self.disable_by_batch_size:
            k = 0
        elif not self.adaptive:
            k = self.k_max
        else:
            k = self._adaptive_k(batch_size)
        self.last_k = k
        return k

    def best_k(self, batch_size: int) -> int:
        b = self.bucket(batch_size)
        for bb in sorted({key[0] for key in self._cost}, key=lambda x: (abs(x - b), -x)):  # this bucket, else nearest
            rates = {k: self.predicted_rate(bb, k) for (kb, k) in self._cost if kb == bb}
            return max(rates, key=lambda k: (rates[k], -k))
        return (self.k_max + 1) // 2  # nothing measured yet: start in the middle and climb

    def _adaptive_k(self, batch_size: int) -> int:
        self._steps += 1
        if self._trial_left:
            self._trial_left -= 1
            return self._trial_k
        b, best = self.bucket(batch_size), self.best_k(batch_size)
        if self._trial_from is not None:  # a trial just ended: back off while the best k holds
            self._interval = min(2 * self._interval, EXPLORE_MAX) if best == self._trial_from else EXPLORE_EVERY
            self._trial_from = None
        around = [k for k in (best - 1, best + 1, 0) if 0 <= k <= self.k_max and k != best]
        unmeasured = [k for k in around if (b, k) not in self._cost]
        if not around or self._steps - self._last_trial < (4 if unmeasured else self._interval):
            return best
        if unmeasured:
            k = unmeasured[0]
        else:
            k, self._rr = around[self._rr % len(around)], self._rr + 1
        self._trial_k, self._trial_left, self._last_trial = k, TRIAL_STEPS - 1, self._steps
        self._trial_from = best
        return k

    # -- measurements ----------------------------------------------------------------------
    def observe_round(self, num_spec: int, num_accepted: int) -> None:
        """One request's verification: num_accepted of its num_spec drafts accepted."""
        self.counters.observe(num_spec, num_accepted)
        if num_spec > 0:
            self._acc = ACC_DECAY * self._acc + num_accepted
            self._evaluated = ACC_DECAY * self._evaluated + min(num_accepted + 1, num_spec)

    def observe_step(self, num_tokens: int, num_decodes: int, k: int, num_draft_tokens: int,
                     seconds: float) -> None:
        """A finished step: scheduled tokens, decoding requests, its k, draft tokens verified, wall time.
        Only decode-only steps whose drafts were proposed at the same k are measured."""
        steady, self._prev_k = self._prev_k == k, k
        if not (self.adaptive and steady and num_decodes and seconds > 0
                and num_tokens == num_decodes + num_draft_tokens):
            return
        c = self._cost.setdefault((self.bucket(num_decodes), k), [0.0, 0.0])
        c[0], c[1] = DECAY * c[0] + seconds / num_decodes, DECAY * c[1] + 1.0
        if k > 0:
            self._fill = DECAY * self._fill + num_draft_tokens / (num_decodes * k)
            self._fill_w = DECAY * self._fill_w + 1.0
