"""Chat templates, rendered to text in a bounded Jinja sandbox: one helper for the CLI, LLM.chat and the server.

Why not `tokenizer.apply_chat_template`: its return type changed between transformers 4 and 5 (a list of ids,
then a BatchEncoding), and it renders with no bound on time or memory, while the server renders templates that
requests supply (`{% set x = 'a' * 500000000 %}` took 8 s and +950 MB). `render_chat_template` renders with our
own ImmutableSandboxedEnvironment, configured as transformers configures its own (trim_blocks, lstrip_blocks,
loop controls, `{% generation %}`, a `tojson` that keeps non-ASCII, `raise_exception`, `strftime_now`, a safe
`dict` and `namespace`), so every template renders the same text, and adds budgets per render:

- no single string or list may exceed `max_chars` (checked *before* `*`, `+`, `~` and the amplifying filters
  and string methods build it), and all such results together may not exceed BUILD_FACTOR x `max_chars`;
- anything turned into text (output, `~`, `%`, `format`, `join`, `string`, ...) may not weigh more than
  `max_chars` (a list holding one long string a million times is as heavy as the string a million times);
- the rendered output may not exceed `max_chars`; one `range()` at most MAX_RANGE items; loop iterations and
  calls at most MAX_STEPS; the whole render at most `timeout_s` seconds.

Past any budget the render stops with a ChatTemplateError (a ValueError; the server answers 400).
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import re
import string
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Callable, Iterable, Optional

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template that cannot be rendered: none to use, bad input, or past one of the render budgets."""


DEFAULT_MAX_CHARS = 2 * 2**20  # ~2M characters: more text than any context this engine serves
DEFAULT_TIMEOUT_S = 2.0
BUILD_FACTOR = 8               # characters/items all operations of one render may build, in units of max_chars
MAX_RANGE = 100_000            # items of one range() (Jinja's own sandbox bound)
MAX_STEPS = 200_000            # loop iterations + calls (macros, methods, filters) in one render
MAX_INT_BITS = 1 << 16         # integers built by `*` and `**`
MAX_JSON_INDENT = 256
_RESERVED = ("messages", "tools", "documents", "add_generation_prompt")
_CONTINUE_MARK = "<<tokenmill-continue-final-message>> "  # its trailing space tells whether the template trimmed it


# -- per-render budget ------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Budget:
    max_chars: int
    timeout_s: float
    deadline: float = 0.0
    built_left: int = 0
    steps_left: int = MAX_STEPS
    output: int = 0

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.timeout_s
        self.built_left = BUILD_FACTOR * self.max_chars

    def step(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise ChatTemplateError(f"chat template exceeds {MAX_STEPS:,} loop iterations and calls")
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"chat template exceeds its time limit of {self.timeout_s:g} s")

    def charge(self, size: int, what: str) -> None:
        """Account for a value of `size` characters (or items) about to be built."""
        if size > self.max_chars:
            raise ChatTemplateError(f"chat template {what} of {size:,} exceeds the limit of {self.max_chars:,}")
        self.built_left -= size
        if self.built_left < 0:
            raise ChatTemplateError(f"chat template builds more than {BUILD_FACTOR * self.max_chars:,} "
                                    "characters in total, which exceeds its limit")

    def check_weight(self, value: Any, what: str) -> None:
        """`value` is about to become text: refuse containers whose text would exceed max_chars."""
        if isinstance(value, (list, tuple, dict, set, frozenset, jinja2.utils.Namespace)):
            weight = _weight(value, self.max_chars)
            if weight > self.max_chars:
                raise ChatTemplateError(f"chat template {what} of over {weight:,} characters exceeds the limit "
                                        f"of {self.max_chars:,}")

    def emit(self, chars: int) -> None:
        self.output += chars
        if self.output > self.max_chars:
            raise ChatTemplateError(f"chat template output exceeds the limit of {self.max_chars:,} characters")


_BUDGET: contextvars.ContextVar[Optional[_Budget]] = contextvars.ContextVar("tokenmill_chat_budget", default=None)


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:  # also what keeps Jinja from folding bounded calls into constants at compile time
        raise ChatTemplateError("chat templates render only inside render_chat_template")
    return budget


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) else 0


def _weight(value: Any, limit: int) -> int:
    """About how many characters `value` becomes as text (every item of every container counts), stopping
    soon after `limit`."""
    total, stack = 0, [value]
    while stack and total <= limit:
        x = stack.pop()
        if isinstance(x, (str, bytes)):
            total += len(x)
        elif isinstance(x, Mapping):
            total += 2 + 4 * len(x)
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(x)
            stack.extend(x)
        elif isinstance(x, jinja2.utils.Namespace):  # its repr shows its attributes
            stack.append(getattr(x, "_Namespace__attrs", {}))
        else:
            total += 8
    return total


# -- operators ---------------------------------------------------------------------------------------------
def _sequence_result_size(op: str, left: Any, right: Any) -> int:
    """Items of the str/bytes/list/tuple that `left op right` builds (0 for anything else)."""
    seqs = (str, bytes, list, tuple)
    if op == "*":
        seq, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, seqs) and isinstance(times, int):
            return len(seq) * max(times, 0)
    elif op == "+" and isinstance(left, seqs) and isinstance(right, seqs):
        return len(left) + len(right)
    return 0


def _check_int_result(op: str, left: Any, right: Any) -> None:
    if not (isinstance(left, int) and isinstance(right, int)):
        return
    if op == "*":
        bits = left.bit_length() + right.bit_length()
    elif op == "**" and right > 0 and abs(left) > 1:
        bits = right * left.bit_length()
    else:
        return
    if bits > MAX_INT_BITS:
        raise ChatTemplateError(f"chat template integer '{op}' result of ~{bits:,} bits exceeds the limit of "
                                f"{MAX_INT_BITS:,}")


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def _percent_specs(fmt: str) -> list[str]:
    return [f"{m.group(1) or ''}.{m.group(2) or ''}" for m in _PERCENT_SPEC.finditer(fmt)]


def _format_specs(fmt: str) -> list[str]:
    return [spec for _, field, spec, _ in string.Formatter().parse(fmt) if field is not None and spec]


def _check_format_widths(budget: _Budget, specs: Iterable[str], values: Iterable[Any]) -> None:
    """Refuse %-/format() widths and precisions past max_chars, including ones taken from the arguments
    (`%*d`, `{:{}}`)."""
    def too_wide(digits: str) -> bool:
        return len(digits) > 12 or int(digits) > budget.max_chars

    values = list(values)
    for spec in specs:
        from_args = "*" in spec or "{" in spec
        if any(too_wide(d) for d in re.findall(r"\d+", spec)) or from_args and any(
                (isinstance(v, int) and abs(v) > budget.max_chars) or (isinstance(v, str) and
                                                                       any(too_wide(d) for d in re.findall(r"\d+", v)))
                for v in values):
            raise ChatTemplateError(f"chat template format width in {spec!r} exceeds the limit of "
                                    f"{budget.max_chars:,} characters")


def _format_args(args: Any) -> list[Any]:
    if isinstance(args, Mapping):
        return list(args.values())
    return list(args) if isinstance(args, tuple) else [args]


# -- string methods and filters that can build far more than they are given ----------------------------------
def _replace_size(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not (isinstance(text, (str, bytes)) and type(old) is type(text) and type(new) is type(text)):
        return 0  # the call itself raises the TypeError
    n = len(text) + 1 if not old else text.count(old)
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(text) + n * max(len(new) - len(old), 0)


def _text_method_size(budget: _Budget, text: Any, name: str, args: tuple) -> int:
    """Size of what str/bytes method `name` builds, for those that can amplify; checks the widths of format()."""
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        return max(len(text), args[0])
    if name == "expandtabs":
        tab = "\t" if isinstance(text, str) else b"\t"
        tabsize = args[0] if args and isinstance(args[0], int) else 8
        return len(text) + text.count(tab) * max(tabsize, 0)
    if name == "replace" and len(args) >= 2:
        return _replace_size(text, *args[:3])
    if name == "join" and args:
        return _weight(args[0], budget.max_chars) + len(text) * max(len(args[0]) - 1, 0)
    if name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
        return len(text) * max(longest, 1)
    if name in ("format", "format_map") and isinstance(text, str):
        _check_format_widths(budget, _format_specs(text), [*args, *(v for a in args[:1] if isinstance(a, Mapping)
                                                                      for v in a.values())])
    return 0


def _sum_size(items: Any, attribute: Any = None, start: Any = 0) -> int:
    """Items `sum` copies: adding lists one by one copies the running total each time."""
    running, copied = _size(start), 0
    for x in items:
        if _size(x):
            running += _size(x)
            copied += running
    return copied


def _indent_size(s: Any, width: Any = 4, *_: Any, **__: Any) -> int:
    pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    s = str(s)
    return len(s) + max(pad, 0) * (s.count("\n") + 1)


def _wordwrap_size(s: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None,
                   *_: Any, **__: Any) -> int:
    s = str(s)
    lines = len(s) // max(width if isinstance(width, int) else 1, 1) + s.count("\n") + 1
    return len(s) + lines * len(str(wrapstring or "\n"))


def _urlize_size(s: Any, *args: Any, **kwargs: Any) -> int:
    extra = sum(_weight(a, _budget().max_chars) for a in (*args, *kwargs.values()))
    return 3 * len(str(s)) + (len(str(s)) // 2 + 1) * (64 + extra)  # every word could become a link


_FILTER_SIZES: dict[str, Callable[..., int]] = {
    "center": lambda value, width=80: max(len(str(value)), width) if isinstance(width, int) else 0,
    "indent": _indent_size,
    "wordwrap": _wordwrap_size,
    "urlize": _urlize_size,
    "replace": lambda s, old, new, count=None: _replace_size(str(s), str(old), str(new),
                                                             -1 if count is None else count),
    "join": lambda items, d="", attribute=None: (_weight(items, _budget().max_chars)
                                                 + len(str(d)) * max(len(items) - 1, 0)),
    "sum": _sum_size,
    # batch pads its last batch to `linecount` items; slice builds `slices` lists
    "batch": lambda value, linecount, fill_with=None: (linecount if fill_with is not None
                                                       and isinstance(linecount, int) else 0),
    "slice": lambda value, slices, fill_with=None: slices if isinstance(slices, int) else 0,
}
# Filters that do not turn their arguments into text; every other filter's arguments are weighed first.
_STRUCTURAL_FILTERS = frozenset({
    "abs", "attr", "batch", "count", "d", "default", "dictsort", "first", "float", "groupby", "int", "items",
    "last", "length", "list", "map", "max", "min", "random", "reject", "rejectattr", "reverse", "round", "select",
    "selectattr", "slice", "sort", "sum", "unique", "tojson"})
_CONSUMES_ITERABLE = frozenset({"join", "sum"})  # their size estimate reads a generator argument first


def _bounded_filter(name: str, fn: Callable) -> Callable:
    estimate = _FILTER_SIZES.get(name)
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # the context/environment Jinja passes

    @functools.wraps(fn)  # keeps jinja_pass_arg
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        head, value, rest = args[:skip], args[skip], args[skip + 1:]
        if name in _CONSUMES_ITERABLE and not isinstance(value, (str, list, tuple)):
            value = list(value)
        if name not in _STRUCTURAL_FILTERS:
            for arg in (value, *rest, *kwargs.values()):
                budget.check_weight(arg, f"'{name}' filter argument")
        if name == "format":
            _check_format_widths(budget, _percent_specs(str(value)), [*rest, *kwargs.values()])
        size = estimate(value, *rest, **kwargs) if estimate is not None else 0
        budget.charge(size, f"'{name}' filter result")
        result = fn(*head, value, *rest, **kwargs)
        if not size:
            budget.charge(_size(result), f"'{name}' filter result")
        return result

    return bounded


# -- the environment ---------------------------------------------------------------------------------------
def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' tojson (json.dumps, non-ASCII kept, no HTML escaping), encoded piece by piece so a
    structure that repeats a long string cannot build gigabytes before the size check."""
    if indent is not None and (indent if isinstance(indent, int) else len(str(indent))) > MAX_JSON_INDENT:
        raise ChatTemplateError(f"chat template tojson indent exceeds the limit of {MAX_JSON_INDENT}")
    budget = _budget()
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)
    pieces, total = [], 0
    for piece in encoder.iterencode(value):
        total += len(piece)
        if total > budget.max_chars:
            raise ChatTemplateError(f"chat template tojson result exceeds the limit of {budget.max_chars:,} "
                                    "characters")
        pieces.append(piece)
    return "".join(pieces)


def _raise_exception(message: Any) -> None:
    _budget().check_weight(message, "raise_exception message")
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _bounded_range(*args: int) -> range:
    try:
        items = range(*args)
        n = len(items)
    except OverflowError:
        n = MAX_RANGE + 1
    if n > MAX_RANGE:
        raise ChatTemplateError(f"chat template range() of more than {MAX_RANGE:,} items exceeds the limit")
    return items


def _bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    if n * max > 100_000:
        raise ChatTemplateError("chat template lipsum() size exceeds the limit")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


def _check_public(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates cannot set the private namespace attribute {name!r}")


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()`: refuses underscore names, which could reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as Jinja's: `self` may be a kwarg
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_public(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_public(name)
        super().__setitem__(name, value)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` in templates, without handing them the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Iterable, value: Any = None) -> dict:
        return dict.fromkeys(keys, value)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it) renders its body."""
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


_HOOKS = ("concat_part", "loop_tick")  # environment methods the generated code calls directly


def _hook_call(name: str, *args: nodes.Expr) -> nodes.Call:
    return nodes.Call(nodes.EnvironmentAttribute(name), list(args), [], None, None)


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles `~` with its parts weighed and its result charged, and counts every loop iteration."""

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        weighed = nodes.Concat([_hook_call("concat_part", part) for part in node.nodes], lineno=node.lineno)
        self.write("environment.concat_result(")
        super().visit_Concat(weighed, frame)
        self.write(")")

    def visit_For(self, node: nodes.For, frame: Any) -> None:
        tick = _hook_call("loop_tick")
        test = tick if node.test is None else nodes.And(tick, node.test)
        counted = nodes.For(node.target, node.iter, node.body, node.else_, test, node.recursive, lineno=node.lineno)
        super().visit_For(counted, frame)

    def visit_Call(self, node: nodes.Call, frame: Any, forward_caller: bool = False) -> None:
        # Our hooks are called directly, not through the sandbox's call() (templates cannot name them: the
        # parser never produces an EnvironmentAttribute).
        if isinstance(node.node, nodes.EnvironmentAttribute) and node.node.name in _HOOKS:
            self.write(f"environment.{node.node.name}(")
            for arg in node.args:
                self.visit(arg, frame)
                self.write(", ")
            self.write(")")
            return
        super().visit_Call(node, frame, forward_caller=forward_caller)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=self._finalize_output,
                         extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, fn) for name, fn in self.filters.items()}
        self.globals.update(range=_bounded_range, lipsum=_bounded_lipsum, raise_exception=_raise_exception,
                            strftime_now=_strftime_now, dict=_TemplateDict(), namespace=_TemplateNamespace)

    @staticmethod
    def _finalize_output(value: Any) -> Any:
        _budget().check_weight(value, "output value")
        return value

    @staticmethod
    def concat_part(value: Any) -> Any:
        _budget().check_weight(value, "'~' operand")
        return value

    @staticmethod
    def concat_result(text: str) -> str:
        _budget().charge(len(text), "'~' result")
        return text

    @staticmethod
    def loop_tick() -> bool:
        _budget().step()
        return True

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        _check_int_result(operator, left, right)
        if operator == "%" and isinstance(left, str):
            budget.check_weight(right, "'%' arguments")
            _check_format_widths(budget, _percent_specs(left), _format_args(right))
        size = _sequence_result_size(operator, left, right)
        budget.charge(size, f"'{operator}' result")
        result = super().call_binop(context, operator, left, right)
        if operator == "%":
            budget.charge(_size(result), "'%' result")
        return result

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget()
        budget.step()
        method = getattr(__obj, "__wrapped__", __obj)  # str.format arrives wrapped by the sandbox
        owner = getattr(method, "__self__", None)
        size = 0
        if isinstance(owner, (str, bytes)):
            if method.__name__ == "join" and args and not isinstance(args[0], (list, tuple)):
                args = (list(args[0]), *args[1:])  # weighed below, then joined
            for arg in (*args, *kwargs.values()):
                budget.check_weight(arg, f"'{method.__name__}' argument")
            size = _text_method_size(budget, owner, method.__name__, args)
            budget.charge(size, f"'{method.__name__}' result")
        result = super().call(__context, __obj, *args, **kwargs)
        if not size:
            budget.charge(_size(result), "call result")
        return result


@functools.lru_cache(maxsize=1)
def _environment() -> _BoundedSandbox:
    return _BoundedSandbox()


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template has a syntax error (line {e.lineno}): {e.message}") from None


# -- inputs ------------------------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """Inputs rebuilt from plain JSON-like types (as transformers does), so templates only ever see objects
    whose methods are harmless; anything else becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):  # subclasses (enums, ...) may carry extra methods
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        return _plain(value.item())
    return f"<{type(value).__name__}>"


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _messages(conversation: Any) -> list[dict]:
    """Plain message dicts; None values dropped and reasoning also under `thinking` and `reasoning_content`,
    as transformers 5 does (templates read one or the other)."""
    if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Iterable):
        raise ChatTemplateError("a conversation must be a list of messages (dicts with 'role' and 'content')")
    messages = []
    for i, message in enumerate(_plain(list(conversation))):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"chat message {i} must be a dict with 'role' and 'content', got {message!r:.80}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        messages.append(message)
    if not messages:
        raise ChatTemplateError("the conversation has no messages")
    return messages


def _tool_schemas(tools: Optional[list]) -> Optional[list]:
    if tools is None:
        return None
    schemas = []
    for tool in tools:
        if isinstance(tool, Mapping):
            schemas.append(tool)
        elif callable(tool):
            from transformers.utils import get_json_schema  # functions with type hints and a docstring

            schemas.append(get_json_schema(tool))
        else:
            raise ChatTemplateError(f"a tool must be a JSON schema (dict) or a documented function, got {tool!r:.80}")
    return _plain(schemas)


def _select_template(tokenizer: Any, chat_template: Optional[str], tools: Optional[list]) -> str:
    """The request's template (or the name of one of the tokenizer's), else the tokenizer's own."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, Mapping):
        if chat_template is not None and chat_template in own:
            return own[chat_template]
        if chat_template is None:
            name = "tool_use" if tools is not None and "tool_use" in own else "default"
            if name not in own:
                raise ChatTemplateError(f"the model has several chat templates and none named 'default'; pass "
                                        f"one of {sorted(own)} as chat_template")
            return own[name]
    template = chat_template or own
    if not template:
        raise ChatTemplateError("the model has no chat template; pass chat_template (the server also takes "
                                "--chat-template) or send plain completions")
    return template


def _template_context(tokenizer: Any, messages: list[dict], tools: Optional[list], add_generation_prompt: bool,
                      template_kwargs: dict[str, Any]) -> dict[str, Any]:
    reserved = sorted(set(template_kwargs) & set(_RESERVED))
    if reserved:
        raise ChatTemplateError(f"chat template arguments cannot set {', '.join(reserved)}")
    documents = template_kwargs.pop("documents", None)
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise ChatTemplateError("documents must be a list of dicts (e.g. with 'title' and 'text')")
    special = dict(getattr(tokenizer, "special_tokens_map", None) or {})
    return {**_plain({**special, **template_kwargs}), "messages": messages, "tools": _tool_schemas(tools),
            "documents": _plain(documents), "add_generation_prompt": add_generation_prompt}


# -- continue_final_message --------------------------------------------------------------------------------
def _mark_final_message(messages: list[dict]) -> str:
    """Append the mark to the final message's (last) text and return that text as it was."""
    final = messages[-1]
    content = final.get("content")
    if isinstance(content, list):
        block = next((b for b in reversed(content) if isinstance(b, dict) and "text" in b), None)
        if block is None:
            raise ChatTemplateError("continue_final_message: the final message has no text to continue")
        text, block["text"] = block["text"], block["text"] + _CONTINUE_MARK
        return text
    if not isinstance(content, str):
        raise ChatTemplateError("continue_final_message: the final message has no content to continue")
    final["content"] = content + _CONTINUE_MARK
    return content


def _cut_at_mark(rendered: str, final_text: str) -> str:
    """The render up to the end of the final message: exactly at the mark, or with the whitespace the
    template would have trimmed from the message removed too."""
    mark = _CONTINUE_MARK.strip()
    if final_text.strip() not in rendered or mark not in rendered:
        raise ChatTemplateError("continue_final_message: the chat template drops part of the final message, "
                                "so it cannot be continued")
    at = rendered.rindex(mark)
    return rendered[:at] if rendered.startswith(_CONTINUE_MARK, at) else rendered[:at].rstrip()


# -- entry point -------------------------------------------------------------------------------------------
def _render(template: jinja2.Template, context: dict[str, Any], max_chars: int, timeout_s: float) -> str:
    budget = _Budget(max_chars, timeout_s)
    token = _BUDGET.set(budget)
    try:
        pieces = []
        for piece in template.generate(context):
            budget.emit(len(piece))
            pieces.append(piece)
        return "".join(pieces)
    except RecursionError:
        raise ChatTemplateError("chat template recursion is too deep") from None
    finally:
        _BUDGET.reset(token)


def render_chat_template(tokenizer: Any, conversation: Any, *, chat_template: Optional[str] = None,
                         add_generation_prompt: bool = True, continue_final_message: bool = False,
                         tools: Optional[list] = None, template_kwargs: Optional[Mapping[str, Any]] = None,
                         max_chars: int = DEFAULT_MAX_CHARS, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """The conversation as the prompt text the model expects (tokenize it with add_special_tokens=False).

    Same text as transformers' `apply_chat_template(..., tokenize=False)` (4.x and 5.x); `template_kwargs`
    become template variables (e.g. enable_thinking, documents) and nothing else: they arrive as one mapping,
    never as keyword arguments, so a request's `max_chars` or `timeout_s` cannot reach the render's own
    limits (which are the caller's, e.g. the server's flags). Raises ChatTemplateError (a ValueError) for a
    missing template, bad input or a render past its budgets; errors a template raises itself
    (`raise_exception`, undefined names) stay jinja2.TemplateError."""
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError("add_generation_prompt and continue_final_message cannot both be true")
    if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
        raise ChatTemplateError(f"chat template arguments must be a mapping, got {type(template_kwargs).__name__}")
    template = _compile(_select_template(tokenizer, chat_template, tools))
    messages = _messages(conversation)
    context = _template_context(tokenizer, messages, tools, add_generation_prompt, dict(template_kwargs or {}))
    final_text = _mark_final_message(messages) if continue_final_message else None
    rendered = _render(template, context, max_chars, timeout_s)
    return rendered if final_text is None else _cut_at_mark(rendered, final_text)
