"""Structured output: grammar-constrained decoding through xgrammar.

The API process validates a request's grammar (`validate`); the engine's model runner keeps one
`StructuredOutputManager`, which compiles grammars once (cached by kind and spec), keeps a matcher per
constrained request, fills a token bitmask for the whole batch each step and advances the matchers with
the sampled tokens. The sampler applies the bitmask, so constrained and free requests share a step.
"""
from tokenmill.structured.manager import StructuredOutputManager, validate

__all__ = ["StructuredOutputManager", "validate"]
