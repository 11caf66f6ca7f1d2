"""Grammar compilation, per-request matchers and the per-step token bitmask (xgrammar)."""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import TYPE_CHECKING, Optional

from tokenmill.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # the API process validates grammars without torch (xgrammar brings it when used)
    import torch

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
    """Engine-side, owned by the scheduler. Compiles each new grammar in a background thread (xgrammar
    releases the GIL), so a new schema never stalls the requests already running; keeps one matcher per
    constrained request; gives each sampled row its allowed-token bitmask and advances the matcher with the
    sampled token. A reasoning model's request (so.reasoning_end) is left free until it has closed its
    reasoning. Nothing is loaded until the first constrained request arrives."""

    def __init__(self, tokenizer_path: Optional[str], vocab_size: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self._compiler = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._grammars: dict[tuple[str, str], Future] = {}
        self._matchers: dict[str, object] = {}
        # so.reasoning_end requests: request id -> its last output tokens while its reasoning is open, None
        # once the closing tag has been generated (the grammar runs from there)
        self._tails: dict[str, Optional[list[int]]] = {}

    def submit(self, so: StructuredOutputsParams) -> None:
        """Start compiling so's grammar (once per distinct grammar). Raises ValueError when structured output
        cannot work at all here."""
        if self.tokenizer_path is None:
            raise ValueError("structured output needs the model's tokenizer (the engine runs without one)")
        _xgr()
        if so.key not in self._grammars:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar")
            self._grammars[so.key] = self._pool.submit(self._compile, so)

    def ready(self, so: StructuredOutputsParams) -> bool:
        """Whether so's grammar is compiled; raises ValueError (the compiler's message) if it failed."""
        future = self._grammars[so.key]
        if not future.done():
            return False
        error = future.exception()
        if error is not None:
            del self._grammars[so.key]  # a later identical request gets the same error, compiled afresh
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"cannot compile the {so.key[0]} grammar: {first}")
        return True

    def wait(self, timeout: float) -> None:
        """Block until some grammar in flight finishes or timeout passes (when nothing else can run)."""
        pending = [f for f in self._grammars.values() if not f.done()]
        if pending:
            futures_wait(pending, timeout, return_when=FIRST_COMPLETED)

    def _compile(self, so: StructuredOutputsParams):
        xgr = _xgr()
        if self._compiler is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.tokenizer_path)
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        t0 = time.perf_counter()
        kind, spec = so.key
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
        return compiled

    def bitmask(self, request_id: str, so: StructuredOutputsParams) -> Optional[torch.Tensor]:
        """[ceil(V/32)] int32 allowed-token bits for the request's next sampled token (its grammar is ready);
        None while the request is still reasoning (so.reasoning_end not generated yet), and once the grammar
        has terminated (e.g. ignore_eos): nothing is left to constrain."""
        if self._reasoning(request_id, so):
            return None
        m = self._matcher(request_id, so)
        if m.is_terminated():
            return None
        mask = _xgr().allocate_token_bitmask(1, self.vocab_size)
        m.fill_next_token_bitmask(mask, 0)
        return mask[0]

    def _matcher(self, request_id: str, so: StructuredOutputsParams):
        m = self._matchers.get(request_id)
        if m is None:
            m = self._matchers[request_id] = _xgr().GrammarMatcher(self._grammars[so.key].result())
        return m

    def _reasoning(self, request_id: str, so: StructuredOutputsParams) -> bool:
        return bool(so.reasoning_end) and self._tails.setdefault(request_id, []) is not None

    def _past_reasoning(self, request_id: str, tokens: list[int], so: StructuredOutputsParams) -> list[int]:
        """The tokens the grammar sees: those after the reasoning's closing tag (none while it is open). The
        last len(tag) - 1 tokens are kept so that a tag sampled across two steps is found."""
        if not self._reasoning(request_id, so):
            return tokens
        end, seen = so.reasoning_end, self._tails[request_id] + tokens
        for k in range(len(seen) - len(end) + 1):
            if seen[k:k + len(end)] == end:
                self._tails[request_id] = None
                return seen[k + len(end):]
        self._tails[request_id] = seen[len(seen) - len(end) + 1:] if len(end) > 1 else []
        return []

    def accept(self, request_id: str, tokens: list[int], so: StructuredOutputsParams) -> None:
        """Advance the request's matcher over its new output tokens (sampled here, or a prefill instance's
        first token: then its matcher starts here); its grammar is compiled."""
        tokens = self._past_reasoning(request_id, tokens, so)
        if not tokens:
            return
        m = self._matcher(request_id, so)
        for t in tokens:
            if not m.is_terminated() and not m.accept_token(t):
                logger.warning("request %s: sampled token %d is outside its grammar", request_id, t)

    def free(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._tails.pop(request_id, None)
