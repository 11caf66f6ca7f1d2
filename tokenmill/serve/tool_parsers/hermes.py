"""`hermes`: Hermes and Qwen models (Qwen2.5, Qwen3, QwQ, NousResearch Hermes 2/3) write each call as
`<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, several in a row for parallel calls, after
optional text."""
from __future__ import annotations

from tokenmill.serve.tool_parsers.base import ToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, tool_names, *, eager: bool = True) -> None:
        super().__init__(tool_names, eager=eager)
        self._state = "text"

    def _step(self) -> bool:
        if self._state == "text":
            if not self._text_until(OPEN):
                return False
            self._begin_call(OPEN)
            self._state = "call"
            return True
        if self._state == "call":
            status = self._feed_call()
            if status is None and not self._final:
                return False
            if status:
                self._state = "close"
            else:  # malformed, or the text ended inside the call
                self._fail()
            return True
        if self._state == "close":
            return self._close()
        return self._skip_to_close()

    def _close(self) -> bool:
        if not self._skip_ws() and not self._final:
            return False
        if self._buf.startswith(CLOSE):
            self._buf = self._buf[len(CLOSE):]
            if not self._complete_call():
                self._fail(suffix=CLOSE)
            else:
                self._state = "text"
            return True
        if CLOSE.startswith(self._buf) and not self._final:
            return False
        self._fail()
        return True

    def _fail(self, suffix: str = "") -> None:
        """Malformed markup: an unsent call's text goes back through as plain text (it may hold a later,
        valid call); a sent call ends and the rest of its markup is skipped."""
        text = self._fail_call()
        if text is None:
            self._state = "skip"
            return
        self._content(OPEN)
        self._buf = text[len(OPEN):] + suffix + self._buf
        self._state = "text"

    def _skip_to_close(self) -> bool:
        at = self._buf.find(CLOSE)
        if at < 0:
            self._buf = self._buf[-(len(CLOSE) - 1):] if not self._final else ""
            return False
        self._buf = self._buf[at + len(CLOSE):]
        self._state = "text"
        return True
