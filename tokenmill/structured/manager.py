"""Grammar compilation, per-request matchers and the per-step token bitmask (xgrammar)."""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from tokenmill.sampling_params import StructuredOutputsParams

logger = logging.getLogger("tokenmill")

_INSTALL_HINT = "structured output needs the xgrammar package: pip install xgrammar"


def _xgr():
    try:
        import xgrammar
    except ImportError:
        raise ValueError(_INSTALL_HINT) from None
    return xgrammar


def _ebnf_literal(s: str) -> str:
    out = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f'"{out}"'


def _choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


# xgrammar (0.2.x) writes a string with maxLength as single characters from [^"\\\r\n]: that admits raw
# control characters (a tab), which JSON forbids. Rewrite that class to JSON's unescaped character set.
_LOOSE_CHAR = r'[^\"\\\r\n]'
_JSON_CHAR = r'[^\0-\x1f\"\\]'


def _json_schema_ebnf(schema: str) -> str:
    """The JSON schema as EBNF: compact (no free whitespace between tokens, so a model cannot pad its
    output with endless newlines; every valid document is still reachable), strings strictly JSON."""
    return str(_xgr().Grammar.from_json_schema(schema, any_whitespace=False)).replace(_LOOSE_CHAR, _JSON_CHAR)


def validate(so: StructuredOutputsParams) -> None:
    """Raise ValueError (naming the problem) for a grammar xgrammar cannot build. Needs no tokenizer,
    so it is cheap enough for the API process; the engine compiles against the vocabulary later."""
    xgr = _xgr()
    kind, spec = so.key
    try:
        if kind == "json":
            xgr.Grammar.from_ebnf(_json_schema_ebnf(spec))
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(_choice_ebnf(so.choice))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"invalid {kind} for structured output: {first}") from None


class StructuredOutputManager:
    """Engine-side state. Nothing is loaded until the first constrained request arrives."""

    def __init__(self, tokenizer_path: str, vocab_size: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self._compiler = None
        self._grammars: dict[tuple[str, str], object] = {}
        self._matchers: dict[str, object] = {}

    def _compile(self, so: StructuredOutputsParams):
        key = so.key
        compiled = self._grammars.get(key)
        if compiled is not None:
            return compiled
        xgr = _xgr()
        if self._compiler is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.tokenizer_path)
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        t0 = time.perf_counter()
        kind, spec = key
        if kind == "json":
            compiled = self._compiler.compile_grammar(_json_schema_ebnf(spec))
        elif kind == "json_object":  # OpenAI's JSON mode: any JSON object
            compiled = self._compiler.compile_grammar(_json_schema_ebnf('{"type": "object"}'))
        elif kind == "regex":
            compiled = self._compiler.compile_regex(spec)
        elif kind == "choice":
            compiled = self._compiler.compile_grammar(_choice_ebnf(so.choice))
        else:
            compiled = self._compiler.compile_grammar(spec)
        logger.debug("compiled %s grammar in %.1f ms", kind, (time.perf_counter() - t0) * 1e3)
        self._grammars[key] = compiled
        return compiled

    def bitmask(self, reqs) -> Optional[torch.Tensor]:
        """[B, ceil(V/32)] int32 allowed-token bits for one step's sampling rows; rows of unconstrained
        requests allow everything. None when no row is constrained."""
        rows = [(i, r) for i, r in enumerate(reqs) if r.sampling_params.structured_outputs is not None]
        if not rows:
            return None
        xgr = _xgr()
        mask = xgr.allocate_token_bitmask(len(reqs), self.vocab_size)  # all ones
        for i, r in rows:
            m = self._matchers.get(r.request_id)
            if m is None:
                m = self._matchers[r.request_id] = xgr.GrammarMatcher(self._compile(r.sampling_params.structured_outputs))
            if not m.is_terminated():  # finished grammar (e.g. ignore_eos): nothing left to constrain
                m.fill_next_token_bitmask(mask, i)
        return mask

    def accept(self, reqs, tokens: list[int]) -> None:
        for r, t in zip(reqs, tokens):
            m = self._matchers.get(r.request_id)
            if m is not None and not m.is_terminated() and not m.accept_token(t):
                logger.warning("request %s: sampled token %d is outside its grammar", r.request_id, t)

    def free(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
