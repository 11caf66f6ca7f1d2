"""What every tool-call parser shares: the events a parser emits, the incremental reader of one call object
(`{"name": ..., "arguments": {...}}`), and the ToolParser base that holds content back around markup.

One class serves both uses. Streaming (`eager=True`): a call is sent as soon as its name is read and known
(ToolCallStart: index, id, name), then its arguments as they arrive (ToolCallArguments fragments), as OpenAI
streams them. Whole text (`extract`, `eager=False`): a call counts only once it is complete and valid, so
malformed output (broken JSON, an unknown function, an unterminated call) comes back as plain content.
A streamed call cannot be taken back: if the model breaks the JSON after the name was sent, the call ends
with the arguments sent so far and the rest of its markup is dropped (never shown as content).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import ClassVar, Collection, Optional, Union


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI sends it

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    text: str


Event = Union[ContentDelta, ToolCallStart, ToolCallArguments]
_WS = " \t\r\n"
# _Scanner.push results
_MORE, _DONE, _SKIP, _ENDED_BEFORE, _ERROR = range(5)


class _Scanner:
    """Finds where one JSON value ends, a character at a time (strings, escapes, nesting). It does not check
    the value's grammar: the finished text is parsed with json.loads."""

    def __init__(self) -> None:
        self.first = ""
        self.depth = 0
        self.in_string = self.escaped = self.scalar = False

    def push(self, ch: str) -> int:
        if not self.first:
            if ch in _WS:
                return _SKIP
            if ch not in '"{[-0123456789tfn':
                return _ERROR
            self.first = ch
            self.in_string, self.depth, self.scalar = ch == '"', int(ch in "{["), ch not in '"{['
            return _MORE
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                return _DONE if self.depth == 0 else _MORE
            return _MORE
        if self.scalar:  # a number or literal ends at the first character that cannot continue it
            return _ENDED_BEFORE if ch in _WS + ",}]" else _MORE
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                return _DONE
        return _MORE


class CallObject:
    """Incremental reader of one call object: `{"name": "f", "<args key>": {...}}`, keys in any order, other
    keys skipped. `name` is set once the name string is read; `args` grows as the arguments object arrives.
    push() returns False at the first character that cannot belong to such an object."""

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self.args_keys = args_keys
        self.name: Optional[str] = None
        self.args = ""
        self.has_args = False
        self.done = False
        self._state = "open"
        self._key: Optional[str] = None
        self._text = ""
        self._scan = _Scanner()

    def push(self, ch: str) -> bool:
        if self.done:
            return False
        if self._state == "value":
            return self._push_value(ch)
        if ch in _WS:
            return True
        if self._state == "open":
            self._state = "key"
            return ch == "{"
        if self._state == "key":
            if ch == "}" and self._key is None:  # {}
                self.done = True
                return True
            if ch != '"':
                return False
            self._state, self._scan, self._text = "key_text", _Scanner(), ""
            return self._push_key(ch)
        if self._state == "key_text":
            return self._push_key(ch)
        if self._state == "colon":
            self._state, self._scan, self._text = "value", _Scanner(), ""
            return ch == ":"
        # after a value
        if ch == ",":
            self._state = "key"
            return True
        self.done = ch == "}"
        return self.done

    def _push_key(self, ch: str) -> bool:
        self._text += ch
        if self._scan.push(ch) == _DONE:
            self._key = json.loads(self._text)
            self._state = "colon"
        return True

    def _push_value(self, ch: str) -> bool:
        r = self._scan.push(ch)
        if r == _ERROR:
            return False
        if r == _SKIP:
            return True
        is_args = self._key in self.args_keys
        if r == _ENDED_BEFORE:
            self._state = "after"
            return self._end_value() and self.push(ch)
        if is_args and (self.has_args or self._scan.first != "{"):
            return False  # arguments must be one JSON object
        self._text += ch
        if is_args:
            self.args += ch
        if r == _DONE:
            self._state = "after"
            return self._end_value()
        return True

    def _end_value(self) -> bool:
        if self._key in self.args_keys:
            self.has_args = True
            return True
        if self._key == "name":
            if self.name is not None:
                return False
            try:
                name = json.loads(self._text)
            except ValueError:
                return False
            if not isinstance(name, str):
                return False
            self.name = name
        return True

    def valid_arguments(self) -> Optional[str]:
        """The arguments JSON text when the object is complete and they are one JSON object (none given: "{}")."""
        if not self.done or self.name is None:
            return None
        if not self.has_args:
            return "{}"
        try:
            return self.args if isinstance(json.loads(self.args), dict) else None
        except ValueError:
            return None


class ToolParser:
    """Base of the parsers: feed() text deltas, finish() at the end; each returns the events to send.

    Subclasses implement _step() over self._buf (return True while they make progress) and use the helpers:
    _content() for text outside markup (whitespace next to a call is dropped), _begin_call() when markup opens
    a call object, _feed_call() to move buffered text into it, _complete_call() when its markup closed,
    _fail_call() for malformed markup (its text, to show as content)."""

    name: ClassVar[str] = ""
    args_keys: ClassVar[tuple[str, ...]] = ("arguments",)

    def __init__(self, tool_names: Collection[str], *, eager: bool = True) -> None:
        self.tool_names = frozenset(tool_names)
        self.eager = eager
        self.calls: list[ToolCall] = []
        self._events: list[Event] = []
        self._buf = ""
        self._final = False
        self._held_ws = ""
        self._after_call = False
        self._obj: Optional[CallObject] = None
        self._region = ""       # text of the current call's markup so far (content again if it fails)
        self._call_id: Optional[str] = None  # set once the current call was sent (committed)
        self._sent = 0          # characters of its arguments sent

    # -- public ------------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while self._step():
            pass
        return self._drain()

    def finish(self) -> list[Event]:
        self._final = True
        while self._step():
            pass
        if self._obj is not None and self._call_id is not None:  # a sent call the text ended inside
            self._end_sent_call()
        if self._held_ws and not self.calls:
            self._events.append(ContentDelta(self._held_ws))
        self._held_ws = ""
        return self._drain()

    def extract(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """(content, tool calls) of a whole text; with no calls, the text unchanged. Needs a fresh parser
        made with eager=False."""
        if self.eager or self.calls or self._buf:
            raise RuntimeError("extract() needs a fresh ToolParser made with eager=False")
        events = self.feed(text) + self.finish()
        if not self.calls:
            return text, []
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        return content or None, list(self.calls)

    # -- for subclasses ----------------------------------------------------------------------------------
    def _step(self) -> bool:
        raise NotImplementedError

    def _drain(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._held_ws + text
        kept = text.rstrip()
        self._held_ws = text[len(kept):]
        if kept:
            self._events.append(ContentDelta(kept))

    def _text_until(self, marker: str) -> bool:
        """Content up to `marker`; True (marker consumed) once it is found. Keeps back an ending that may be
        the start of the marker, until more text (or the end) shows it is not."""
        at = self._buf.find(marker)
        if at >= 0:
            self._content(self._buf[:at])
            self._buf = self._buf[at + len(marker):]
            return True
        keep = 0 if self._final else _partial_suffix(self._buf, marker)
        self._content(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _skip_ws(self) -> bool:
        """Drop leading whitespace; True when a non-space character is next."""
        self._buf = self._buf.lstrip()
        return bool(self._buf)

    def _begin_call(self, markup: str = "") -> None:
        self._obj = CallObject(self.args_keys)
        self._region, self._call_id, self._sent = markup, None, 0

    def _feed_call(self) -> Optional[bool]:
        """Move buffered text into the call object: True when it is complete, False when it is malformed,
        None when it needs more text."""
        obj = self._obj
        for i, ch in enumerate(self._buf):
            ok = obj.push(ch)
            if ok and obj.name is not None and obj.name not in self.tool_names:
                ok = False
            if not ok or obj.done:
                self._region += self._buf[:i + 1]
                self._buf = self._buf[i + 1:]
                self._stream_call()
                return obj.done and ok
        self._region += self._buf
        self._buf = ""
        self._stream_call()
        return None

    def _step_call_into(self, next_state: str) -> bool:
        """The "call" state of the JSON-list formats: feed the call; a complete, known call moves on to
        `next_state` (the separator), anything else is the subclass's _fail."""
        status = self._feed_call()
        if status is None and not self._final:
            return False
        if status and self._complete_call():
            self._state = next_state
        else:
            self._fail()
        return True

    def _stream_call(self) -> None:
        obj = self._obj
        if not self.eager or obj.name is None or obj.name not in self.tool_names:
            return
        if self._call_id is None:
            self._call_id = new_call_id()
            self._held_ws = ""
            self._events.append(ToolCallStart(len(self.calls), self._call_id, obj.name))
        if len(obj.args) > self._sent:
            self._events.append(ToolCallArguments(len(self.calls), obj.args[self._sent:]))
            self._sent = len(obj.args)

    def _complete_call(self) -> bool:
        """The call's markup closed: record it (send it now if it was not streamed). False if it is malformed
        and was not sent (the caller shows its text as content)."""
        obj = self._obj
        args = obj.valid_arguments()
        if self._call_id is None:
            if args is None:
                return False
            self._call_id = new_call_id()
            self._held_ws = ""
            self._events.append(ToolCallStart(len(self.calls), self._call_id, obj.name))
            self._events.append(ToolCallArguments(len(self.calls), args))
            self._sent = len(args)
        elif args is not None and not obj.has_args:  # sent before we knew it has no arguments
            self._events.append(ToolCallArguments(len(self.calls), args))
        self._end_sent_call(args if args is not None else obj.args)
        return True

    def _end_sent_call(self, args: Optional[str] = None) -> None:
        obj = self._obj
        if args is None:
            args = obj.args if obj.has_args or obj.args else "{}"
        self.calls.append(ToolCall(self._call_id, obj.name, args))
        self._obj, self._region, self._call_id = None, "", None
        self._after_call = True

    def _fail_call(self) -> Optional[str]:
        """The current call is malformed. Not sent: returns its text so far (show it as content). Sent: ends
        it with the arguments sent and returns None (the caller drops the rest of its markup)."""
        if self._call_id is not None:
            self._end_sent_call()
            return None
        text, self._obj, self._region = self._region, None, ""
        return text


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest ending of text that is a proper beginning of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
