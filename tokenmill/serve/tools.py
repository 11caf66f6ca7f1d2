"""Tool calling for /v1/chat/completions (and whatever front translates to it, such as the Responses API).

- parse_tools(): check a request's `tools` (OpenAI's {"type": "function", "function": {...}}) -> FunctionTool
- plan_tools(): tools + tool_choice + parallel_tool_calls -> ToolPlan. Its `constraint` is the guided-decoding
  grammar that makes 'required' and a named function valid by construction (None for 'none' and 'auto');
  its `extract(text)` turns a generated text into (content, tool calls); `stream()` does it as text streams.
- template_messages(): a conversation's assistant tool_calls and tool results as chat templates expect them.

'required' generates `[{"name": <one of the tools>, "parameters": <that tool's schema>}, ...]`; a named
function generates its arguments object alone. 'auto' reads the model's own markup with the server's
--tool-call-parser (tool_parsers/).
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

from tokenmill.http.errors import bad_request
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.serve.protocol import RequestLimits, check_grammar_size, json_depth
from tokenmill.serve.tool_parsers import (CallArrayParser, ContentDelta, Event, ToolCall, ToolCallArguments,
                                          ToolCallStart, ToolParser, get_tool_parser, new_call_id)

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
AUTO_FLAGS = "--enable-auto-tool-choice and --tool-call-parser"


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None  # JSON schema of the arguments object; None: no arguments

    def schema(self) -> dict:
        return self.parameters if self.parameters is not None else NO_PARAMETERS

    def to_template(self) -> dict:
        """The tool as chat templates read it (OpenAI's shape)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.schema()
        return {"type": "function", "function": fn}


def check_tool_count(tools: Optional[list], limits: RequestLimits, param: str = "tools") -> None:
    """--max-tools, before anything else looks at the tools (cheap enough for the event loop)."""
    if tools is not None and len(tools) > limits.max_tools:
        raise bad_request(f"{param} lists {len(tools)} tools; at most {limits.max_tools} are allowed "
                          "(--max-tools)", param)


def parse_tools(tools: Optional[list], limits: RequestLimits = RequestLimits(),
                param: str = "tools") -> list[FunctionTool]:
    """Chat-completions `tools` -> FunctionTools; a 400 naming the first bad entry, a duplicate name, or the
    limit exceeded (--max-tools, --max-tools-schema-bytes, each schema's --max-json-schema-depth). Linear in
    the size of the tools; still, run it off the event loop (chat.py does)."""
    check_tool_count(tools, limits, param)
    _check_tools_size(tools or [], limits, param)
    out: list[FunctionTool] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools or []):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function must be an object with a name", f"{where}.function")
        out.append(function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"{where}.function",
                                 limits))
        if out[-1].name in seen:
            raise bad_request(f"{param} names the function {out[-1].name!r} more than once", param)
        seen.add(out[-1].name)
    return out


def _check_tools_size(tools: list, limits: RequestLimits, param: str) -> None:
    try:
        size = len(json.dumps(tools, separators=(",", ":"), ensure_ascii=False).encode())
    except (TypeError, ValueError, RecursionError):  # the body was JSON, so only nesting too deep to walk
        raise bad_request(f"{param} nest too deeply", param) from None
    if size > limits.max_tools_schema_bytes:
        raise bad_request(f"{param} are {size} bytes as JSON; at most {limits.max_tools_schema_bytes} are "
                          "allowed (--max-tools-schema-bytes)", param)


def function_tool(name: Any, description: Any, parameters: Any, where: str,
                  limits: RequestLimits = RequestLimits()) -> FunctionTool:
    """One checked function definition (`where` names it in errors)."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad_request(f"{where}.name must be 1-64 letters, digits, '_' or '-', got {str(name)[:80]!r}",
                          f"{where}.name")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.description must be a string", f"{where}.description")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise bad_request(f"{where}.parameters must be a JSON schema object", f"{where}.parameters")
        if parameters.get("type", "object") != "object":
            raise bad_request(f"{where}.parameters must be a JSON schema of type 'object' (the arguments "
                              f"object), got type {parameters.get('type')!r}", f"{where}.parameters")
        if json_depth(parameters, limits.max_json_schema_depth) > limits.max_json_schema_depth:
            raise bad_request(f"{where}.parameters nests deeper than {limits.max_json_schema_depth} levels "
                              "(--max-json-schema-depth)", f"{where}.parameters")
    return FunctionTool(name, description, parameters)


def _rebase_refs(schema: Any, base: str) -> Any:
    """The schema with its local $refs ("#", "#/...") pointing under `base`, where it is moved to."""
    if isinstance(schema, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase_refs(v, base))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    return schema


def required_calls_schema(tools: list[FunctionTool], parallel: bool) -> dict:
    """JSON schema of tool_choice 'required' output: an array of one or more {"name", "parameters"} objects,
    each pairing a tool's name with that tool's arguments schema (each schema under $defs, its refs moved)."""
    defs, cases = {}, []
    for i, tool in enumerate(tools):
        defs[f"tool{i}"] = _rebase_refs(copy.deepcopy(tool.schema()), f"#/$defs/tool{i}")
        cases.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool.name]},
                                                       "parameters": {"$ref": f"#/$defs/tool{i}"}},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": cases[0] if len(cases) == 1 else {"anyOf": cases},
              "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _chosen_function(tool_choice: dict, tools: list[FunctionTool]) -> str:
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else tool_choice.get("name")  # chat / Responses shape
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", "tool_choice")
    if name not in {t.name for t in tools}:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the request's tools "
                          f"({', '.join(t.name for t in tools) or 'none given'})", "tool_choice")
    return name


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for one generation: mode 'none' | 'auto' | 'required' | 'function'."""
    mode: str
    tools: tuple[FunctionTool, ...] = ()
    function: Optional[str] = None                         # mode 'function': the one to call
    parallel: bool = True
    parser: Optional[str] = None                           # mode 'auto': the --tool-call-parser
    constraint: Optional[StructuredOutputsParams] = None   # the guided-decoding grammar, if any

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"

    def template_tools(self) -> Optional[list[dict]]:
        """The tools for the chat template (tools=), None when there are none."""
        return [t.to_template() for t in self.tools] or None

    def new_parser(self, eager: bool) -> Optional[ToolParser]:
        names = [t.name for t in self.tools]
        if self.mode == "function":
            return NamedCallParser(self.function, eager=eager)
        if self.mode == "required":
            return CallArrayParser(names, eager=eager, marker=None, args_keys=("parameters",))
        if self.mode == "auto":
            return get_tool_parser(self.parser)(names, eager=eager)
        return None

    def extract(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """(content, tool calls) of a finished generation's text. No calls found: (text, [])."""
        parser = self.new_parser(eager=False)
        if parser is None:
            return text, []
        content, calls = parser.extract(text)
        return content, calls if self.parallel else calls[:1]

    def stream(self) -> Optional["ToolCallStream"]:
        """A per-choice incremental extractor, None when nothing is to be parsed."""
        parser = self.new_parser(eager=True)
        return ToolCallStream(parser, 1 << 30 if self.parallel else 1) if parser is not None else None

    @staticmethod
    def finish_reason(reason: Optional[str], called: bool) -> Optional[str]:
        """'tool_calls' when the model stopped after calling tools (a cut-off generation stays 'length')."""
        return "tool_calls" if called and reason == "stop" else reason


def plan_tools(tools: list[FunctionTool], tool_choice: Union[None, str, dict], parallel_tool_calls: Optional[bool],
               *, auto_parser: Optional[str], limits: Optional[RequestLimits] = None) -> ToolPlan:
    """The ToolPlan for a request; a 400 for a choice that cannot be served. tool_choice defaults to 'auto'
    with tools (OpenAI's default), which needs the server's --enable-auto-tool-choice --tool-call-parser.
    `limits` (RequestLimits) bounds the constraint's schema."""
    parallel = parallel_tool_calls is not False
    if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
        raise bad_request("tool_choice must be a string or an object", "tool_choice")
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a named function, got "
                          f"{tool_choice[:40]!r}", "tool_choice")
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice 'required' or a named function needs tools", "tool_choice")
        return ToolPlan("none")
    if tool_choice == "none":
        return ToolPlan("none", tuple(tools))
    if tool_choice is None or tool_choice == "auto":
        if auto_parser is None:
            raise bad_request(f"tool_choice 'auto' (the default when tools are given) needs the server started "
                              f"with {AUTO_FLAGS}; or send tool_choice 'required', 'none' or a named function",
                              "tool_choice" if tool_choice else "tools")
        return ToolPlan("auto", tuple(tools), parallel=parallel, parser=auto_parser)
    if tool_choice == "required":
        schema = required_calls_schema(tools, parallel)
        return ToolPlan("required", tuple(tools), parallel=parallel,
                        constraint=_constraint(schema, limits, "tools"))
    name = _chosen_function(tool_choice, tools)
    schema = next(t for t in tools if t.name == name).schema()
    return ToolPlan("function", tuple(tools), function=name, parallel=parallel,
                    constraint=_constraint(schema, limits, "tools"))


def _constraint(schema: dict, limits: Optional[RequestLimits], param: str) -> StructuredOutputsParams:
    from tokenmill.structured import validate  # ~5 ms (structured.manager): only when a constraint is built

    so = StructuredOutputsParams(json=json.dumps(schema))
    if limits is not None:
        check_grammar_size(so, limits, param)
    try:
        validate(so)
    except ValueError as e:
        raise bad_request(f"the tools' parameter schemas cannot be used for tool_choice: {e}", param) from None
    return so


class NamedCallParser(ToolParser):
    """Output of a named tool_choice: the text is the arguments object of that one function."""

    def __init__(self, function: str, *, eager: bool = True) -> None:
        super().__init__([function], eager=eager)
        self.function = function
        self._args = ""

    def _step(self) -> bool:
        if self.eager and self._call_id is None and (self._buf or self._final):
            self._call_id = new_call_id()
            self._events.append(ToolCallStart(0, self._call_id, self.function))
        if self.eager and self._buf:
            self._events.append(ToolCallArguments(0, self._buf))
        self._args += self._buf
        self._buf = ""
        if self._final and self._call_id is not None:
            self.calls.append(ToolCall(self._call_id, self.function, self._args))
            self._call_id = None
        elif self._final and not self.calls:
            self._finish_whole()
        return False

    def _finish_whole(self) -> None:
        try:
            valid = isinstance(json.loads(self._args), dict)
        except ValueError:
            valid = False
        if valid:
            self._call_id = new_call_id()
            self._events += [ToolCallStart(0, self._call_id, self.function), ToolCallArguments(0, self._args)]
            self.calls.append(ToolCall(self._call_id, self.function, self._args))
            self._call_id = None
        else:
            self._content(self._args)


class ToolCallStream:
    """One choice's streamed text -> OpenAI chat deltas: {"content": ...}, or {"tool_calls": [...]} whose first
    entry for a call carries index, id, type, function.name and arguments "", later ones argument fragments."""

    def __init__(self, parser: ToolParser, max_calls: int) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.called = False  # a call was sent

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self.parser.feed(text) if text else [])

    def finish(self) -> list[dict]:
        return self._deltas(self.parser.finish())

    def _deltas(self, events: Iterable[Event]) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if isinstance(e, ContentDelta):
                if out and "content" in out[-1]:
                    out[-1]["content"] += e.text
                else:
                    out.append({"content": e.text})
                continue
            if e.index >= self.max_calls:  # parallel_tool_calls false: the first call only
                continue
            if isinstance(e, ToolCallStart):
                self.called = True
                out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                            "function": {"name": e.name, "arguments": ""}}]})
                continue
            last = out[-1]["tool_calls"][0] if out and "tool_calls" in out[-1] else None
            if last is not None and "id" not in last and last["index"] == e.index:
                last["function"]["arguments"] += e.text
            else:
                out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
        return out


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages (plain dicts) as chat templates expect tool use: an assistant's tool_calls with `arguments` as
    an object (OpenAI sends a JSON string; Qwen, Hermes, Llama and Mistral templates write it with tojson),
    a tool result with its tool_call_id. A 400 for a malformed call or result."""
    out = []
    for i, m in enumerate(messages):
        if m.get("role") == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise bad_request(f"messages[{i}]: a 'tool' message needs tool_call_id (the id of the call it "
                              "answers)", f"messages[{i}].tool_call_id")
        calls = m.get("tool_calls")
        if calls is None:
            out.append(m)
            continue
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise bad_request(f"messages[{i}].tool_calls must be a list on an assistant message",
                              f"messages[{i}].tool_calls")
        out.append({**m, "tool_calls": [_template_call(c, f"messages[{i}].tool_calls[{j}]")
                                        for j, c in enumerate(calls)]})
    return out


def _template_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                          "\"arguments\"}}}}", where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad_request(f"{where}.function.arguments is not valid JSON", f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise bad_request(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    return {**call, "type": "function", "function": {**fn, "arguments": args}}
