"""SamplingParams: vLLM-compatible sampling fields, validated once at construction."""
from __future__ import annotations

import math
from typing import Optional, Union

import msgspec

_GREEDY_EPS = 1e-5
# repetition_penalty divides (or multiplies) logits: 1e-300 made them infinite and the model emitted
# end-of-text at every step. vLLM and TGI only ask for > 0; [0.01, 100] keeps every logit finite in bf16.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    """Constrain generation to a grammar (vLLM's names). Exactly one field is set; `json` is a JSON schema
    as a string. Enforced by tokenmill/structured/ through a token bitmask in the sampler."""
    json: Optional[str] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None  # EBNF (GBNF dialect)
    # A reasoning model's closing tag as token ids (--reasoning-parser): the grammar starts after the model has
    # generated it, so that the reasoning before it is free text; None when the prompt already closed it.
    reasoning_end: Optional[list[int]] = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, json_object, regex, choice, "
                             f"grammar; got {kinds or 'none'}.")
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs choice must list at least one string.")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec): what a compiled grammar is cached by."""
        if self.json is not None:
            return "json", self.json
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", msgspec.json.encode(self.choice).decode()
        return "grammar", self.grammar


class SamplingParams(msgspec.Struct, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(field: str, msg: str) -> None:
            raise ValueError(f"{field} {msg}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):  # NaN passes every range check below
                bad(name, f"must be a finite number, got {getattr(self, name)}.")
        if self.logit_bias and not all(math.isfinite(v) for v in self.logit_bias.values()):
            bad("logit_bias", "values must be finite numbers.")
        if self.n < 1:
            bad("n", f"must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            bad("temperature", f"must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            bad("top_k", f"must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}.")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}], got "
                f"{self.repetition_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", f"must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", f"must be non-negative, got {self.prompt_logprobs}.")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative token ids.")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            bad("seed", f"must fit in a signed 64-bit integer, got {self.seed}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def clone(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)
