"""Tool-call parsers for tool_choice 'auto' (`--tool-call-parser NAME`, vLLM's names): each reads one model
family's tool-call markup out of generated text, whole (`extract`) or as it streams (`feed`/`finish`).
Add a format by subclassing ToolParser in its own module and listing it here."""
from __future__ import annotations

from tokenmill.serve.tool_parsers.base import (ContentDelta, Event, ToolCall, ToolCallArguments, ToolCallStart,
                                              ToolParser, new_call_id)
from tokenmill.serve.tool_parsers.hermes import HermesToolParser
from tokenmill.serve.tool_parsers.llama3_json import Llama3JsonToolParser
from tokenmill.serve.tool_parsers.mistral import CallArrayParser, MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["TOOL_PARSERS", "CallArrayParser", "ContentDelta", "Event", "ToolCall", "ToolCallArguments",
           "ToolCallStart", "ToolParser", "get_tool_parser", "new_call_id"]
