"""Structured output: grammar-constrained decoding through xgrammar.

The API process validates a request's grammar (`validate`); the engine's scheduler keeps one
`StructuredOutputManager`, which compiles grammars once in a background thread (cached by kind and spec;
a request waits, without holding up others, until its grammar is ready, and fails alone if it does not
compile), keeps a matcher per constrained request, hands each sampled row its token bitmask in the
ScheduledRequest and advances the matcher with the sampled tokens in the scheduler's update. The sampler
applies the bitmask, so constrained and free requests share a step.
"""
from tokenmill.structured.manager import StructuredOutputManager, validate

__all__ = ["StructuredOutputManager", "validate"]
