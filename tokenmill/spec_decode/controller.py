"""When to speculate and how far (the scheduler asks once per step), and the acceptance counters.

Speculation and large batches compete for the same compute: verifying k drafts for B requests runs
B(k + 1) tokens, which costs about what B decodes cost only while the step is memory-bound.

- disable_by_batch_size N: no speculation in a step with N or more running requests.
- adaptive: pick k in 0..k_max maximising predicted tokens per second,
      B * (1 + phi * a (1 - a^k) / (1 - a))  /  (t_target(B (1 + phi k)) + t_draft(k, B))
  with a the measured per-token acceptance (accepted / evaluated draft positions, i.i.d. model), phi the
  fraction of the k slots drafters fill (n-gram finds no match for some requests), t_target a linear fit
  of step time against scheduled tokens, t_draft a linear fit of drafter time per draft step against
  batch size. All are exponentially decayed so they follow the workload. Every EXPLORE_EVERY steps the
  controller tries another k for two steps (propose, verify), round robin over 0..k_max, so the cost fit
  sees several step sizes and a stays measured while speculation is off.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.97
EXPLORE_EVERY = 8


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


class _LinearFit:
    """Exponentially decayed least squares y = c0 + c1 x."""

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float) -> None:
        d = DECAY
        self.w, self.x, self.y = d * self.w + 1, d * self.x + x, d * self.y + y
        self.xx, self.xy = d * self.xx + x * x, d * self.xy + x * y

    @property
    def ready(self) -> bool:
        return self.w >= 3

    def __call__(self, x: float) -> float:
        if self.w == 0:
            return 0.0
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        slope = (self.xy / self.w - mx * my) / var if var > 1e-9 * max(mx * mx, 1.0) else 0.0
        slope = max(slope, 0.0)  # more tokens never make a step cheaper
        return max(my + slope * (x - mx), 0.0)


class SpecController:
    def __init__(self, k_max: int, disable_by_batch_size=None, adaptive: bool = False,
                 keeps_kv: bool = False) -> None:
        self.k_max = k_max
        self.disable_by_batch_size = disable_by_batch_size
        self.adaptive = adaptive
        self.keeps_kv = keeps_kv              # the drafter runs (to keep its KV) even when k = 0
        self.counters = SpecDecodeCounters()
        self.acc = 0.6 * 4                    # decayed accepted / evaluated positions, prior a = 0.6
        self.evaluated = 4.0
        self.fill, self.fill_w = 1.0, 1.0     # decayed fraction of k slots that held drafts
        self.target = _LinearFit()            # step seconds (minus drafting) vs scheduled tokens
        self.draft = _LinearFit()             # drafter seconds per draft step vs batch size
        self.last_k = k_max
        self._steps = 0
        self._explore_k = 0
        self._explore_left = 0

    # -- decisions -------------------------------------------------------------------------
    def choose_k(self, batch_size: int) -> int:
        if self.k_max <= 0 or batch_size <= 0:
            return 0
        if self.disable_by_batch_size is not None and batch_size >= self.disable_by_batch_size:
            k = 0
        elif not self.adaptive:
            k = self.k_max
        else:
            k = self._adaptive_k(batch_size)
        self.last_k = k
        return k

    def _adaptive_k(self, batch_size: int) -> int:
        self._steps += 1
        if self._explore_left:  # a trial runs two steps: propose with k, then verify k drafts
            self._explore_left -= 1
            return self._explore_k
        best = self._best_k(batch_size)
        if self._steps % EXPLORE_EVERY == 0:
            # Now and then another k, round robin: the step-cost fit needs several step sizes (all steps at
            # one k give it no slope), and acceptance must stay measured while speculation is off.
            self._explore_k = (self._explore_k + 1) % (self.k_max + 1)
            if self._explore_k == best:
                self._explore_k = (self._explore_k + 1) % (self.k_max + 1)
            self._explore_left = 1
            return self._explore_k
        return best

    @property
    def acceptance(self) -> float:
        return min(max(self.acc / self.evaluated, 0.0), 0.999)

    def predicted_rate(self, k: int, batch_size: int) -> float:
        """Predicted output tokens per second with k drafts per request."""
        a, phi, B = self.acceptance, min(self.fill / self.fill_w, 1.0), batch_size
        emitted = B * (1.0 + phi * a * (1.0 - a ** k) / (1.0 - a))
        cost = self.target(B * (1.0 + phi * k))
        draft_steps = max(k, 1) if self.keeps_kv else k
        cost += draft_steps * self.draft(B)
        return emitted / cost if cost > 0 else float("inf")

    def _best_k(self, batch_size: int) -> int:
        if not self.target.ready:
            return self.k_max  # no measurements yet: start speculating and learn
        rates = [self.predicted_rate(k, batch_size) for k in range(self.k_max + 1)]
        return max(range(self.k_max + 1), key=lambda k: (rates[k], -k))

    # -- measurements ----------------------------------------------------------------------
    def observe_round(self, num_spec: int, num_accepted: int) -> None:
        """One request's verification: num_accepted of its num_spec drafts accepted."""
        self.counters.observe(num_spec, num_accepted)
        if num_spec > 0:
            self.acc = DECAY * self.acc + num_accepted
            self.evaluated = DECAY * self.evaluated + min(num_accepted + 1, num_spec)

    def observe_step(self, num_tokens: int, num_decodes: int, k: int, num_draft_tokens: int,
                     seconds: float, draft_seconds: float) -> None:
        """A finished step: its scheduled tokens, decode requests, k, draft tokens verified, wall times.
        Steps with prefill chunks (another cost regime) do not enter the step-cost fit."""
        if num_tokens == num_decodes + num_draft_tokens:
            self.target.add(num_tokens, max(seconds - draft_seconds, 0.0))
        if k > 0 and num_decodes > 0:
            self.fill = DECAY * self.fill + num_draft_tokens / (num_decodes * k)
            self.fill_w = DECAY * self.fill_w + 1
        steps = max(k, 1) if self.keeps_kv else k
        if steps and num_decodes > 0 and draft_seconds > 0:
            self.draft.add(num_decodes, draft_seconds / steps)
