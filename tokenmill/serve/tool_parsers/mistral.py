"""`mistral`: Mistral models write `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` after optional
text. [TOOL_CALLS] is a special token in Mistral tokenizers: send `skip_special_tokens: false` so it
reaches the parser. CallArrayParser (the array alone, no marker) also reads tool_choice 'required' output."""
from __future__ import annotations

from typing import Collection, Optional

from tokenmill.serve.tool_parsers.base import ToolParser

TOOL_CALLS = "[TOOL_CALLS]"


class CallArrayParser(ToolParser):
    """A JSON array of call objects, after `marker` (None: the text starts with the array, as tool_choice
    'required' generates it; a cut-off tail after complete calls is then dropped, not shown as content)."""

    def __init__(self, tool_names: Collection[str], *, eager: bool = True, marker: Optional[str] = TOOL_CALLS,
                 args_keys: tuple[str, ...] = ("arguments",)) -> None:
        super().__init__(tool_names, eager=eager)
        self.marker = marker
        self.args_keys = args_keys
        self._state = "text" if marker else "open"

    def _step(self) -> bool:
        if self._state == "text":
            if self.marker is None or not self._text_until(self.marker):
                if self.marker is None:
                    self._content(self._buf)
                    self._buf = ""
                return False
            self._state = "open"
            return True
        if self._state == "open":
            body = self._buf.lstrip()
            if not body:
                return self._final and self._fail_open()
            if body[0] != "[":
                return self._fail_open()
            self._buf = body[1:]
            self._begin_call((self.marker or "") + "[")
            self._state = "call"
            return True
        if self._state == "call":
            return self._step_call_into("sep")
        if self._state == "sep":
            if not self._skip_ws():
                return False
            ch, self._buf = self._buf[0], self._buf[1:]
            if ch == ",":
                self._begin_call(",")
                self._state = "call"
            elif ch == "]":
                self._state = "after"
            else:
                self._buf = ch + self._buf
                self._fail()
            return True
        if self._state == "after":  # text after the array is content
            self._content(self._buf)
            self._buf = ""
            return False
        self._buf = ""  # skip: the rest of a call that broke after it was sent
        return False

    def _fail_open(self) -> bool:
        self._content((self.marker or "") + self._buf)
        self._buf = ""
        self._state = "after"
        return True

    def _fail(self) -> None:
        text = self._fail_call()
        if text is None or (self.marker is None and self.calls):  # no marker: constrained output, never prose
            self._state = "skip"
            return
        self._content(text)
        self._state = "after"


class MistralToolParser(CallArrayParser):
    name = "mistral"

    def __init__(self, tool_names: Collection[str], *, eager: bool = True) -> None:
        super().__init__(tool_names, eager=eager)
