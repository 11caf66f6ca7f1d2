"""`llama3_json`: Llama 3.1/3.2/3.3 JSON tool calls. The whole answer is the call(s): an optional
`<|python_tag|>` (kept when skip_special_tokens is false), then `{"name": "f", "parameters": {...}}`
objects separated by `;`. An answer that does not start that way is plain content."""
from __future__ import annotations

from tokenmill.serve.tool_parsers.base import ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    args_keys = ("parameters", "arguments")

    def __init__(self, tool_names, *, eager: bool = True) -> None:
        super().__init__(tool_names, eager=eager)
        self._state = "start"
        self._lead = ""  # what came before the first call object (whitespace, the python tag)

    def _step(self) -> bool:
        if self._state == "start":
            return self._start()
        if self._state == "text":
            self._content(self._buf)
            self._buf = ""
            return False
        if self._state == "call":
            return self._step_call_into("sep")
        if self._state == "sep":
            if not self._skip_ws():
                return False
            if self._buf[0] != ";":
                self._fail()
                return True
            self._buf = self._buf[1:]
            self._begin_call(";")
            self._state = "call"
            return True
        self._buf = ""  # skip: the rest of a call that broke after it was sent
        return False

    def _start(self) -> bool:
        body = self._buf.lstrip()
        lead = self._buf[:len(self._buf) - len(body)]
        if body.startswith(PYTHON_TAG):
            self._lead, self._buf = lead + PYTHON_TAG, body[len(PYTHON_TAG):]
            return self._start()
        if not body or (PYTHON_TAG.startswith(body) and not self._final):
            return self._final and self._to_text()
        if body[0] != "{":
            return self._to_text()
        self._begin_call(self._lead + lead)
        self._buf = body
        self._state = "call"
        return True

    def _to_text(self) -> bool:
        self._buf, self._lead = self._lead + self._buf, ""
        self._state = "text"
        return True

    def _fail(self) -> None:
        """Malformed: an unsent call's text and all after it is content; a sent call ends, the rest is dropped."""
        text = self._fail_call()
        if text is None:
            self._state = "skip"
            return
        self._content(text)
        self._state = "text"
