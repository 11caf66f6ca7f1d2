"""Reasoning output (`--reasoning-parser`): a thinking model's text split into its reasoning and its answer,
whole (`split`) or as it streams (`ReasoningStream`), so that chat completions carry the thinking in
`message.reasoning_content` (and `reasoning`) and the Responses API in a reasoning item.

Both parsers read `<think> ... </think>`, as their models write it, and where the output starts comes from the
prompt's end (ReasoningParser.state_after):
- qwen3: the model opens the block itself (`<think>` leads its output); with `enable_thinking` false the
  template puts an empty block in the prompt and the output is all answer. An output that does not open a
  block is all answer. (Templates that open the block in the prompt, as Qwen3's 2507 thinking models' do,
  want deepseek_r1.)
- deepseek_r1: the template ends the prompt inside the block (`<think>\\n`), so the output starts in the
  reasoning (a leading `<think>`, which older checkpoints still write, is dropped); text up to `</think>` is
  reasoning, and an output cut before it is all reasoning.
- openai_gptoss: gpt-oss's harmony format, messages `<|start|>{role}<|channel|>{channel}<|message|>{text}` ended by
  `<|end|>`, `<|return|>` or `<|call|>` (HarmonyParser). The `analysis` channel is the reasoning; `final` (and
  `commentary`, where tool-call preambles go) the answer; the markup is dropped. Those markers are special
  tokens, so with this parser the chat API detokenizes with them (`keep_special_tokens`). The template ends the
  prompt with `<|start|>assistant`: the output starts with a message header.
Tool calls and structured output apply to the answer only: the tool parsers read the answer text, and a
grammar starts once the model has closed its reasoning (`reasoning_end`, structured/manager.py: the parser's
`end`, for harmony the final channel's header).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_in_reasoning: bool  # the prompt leaves the model inside the block
    start: str = "<think>"
    end: str = "</think>"
    keep_special_tokens = False  # the tags are text in these models' outputs

    def stream(self, prompt: str = "") -> "ReasoningStream":
        """A splitter for one streamed output of `prompt`."""
        return ReasoningStream(self, prompt)

    def split(self, text: str, prompt: str = "") -> tuple[Optional[str], Optional[str]]:
        """(reasoning, answer) of a whole output of `prompt`; None where a part is absent or empty."""
        reasoning, answer = ReasoningStream(self, prompt).feed(text, last=True)
        return reasoning or None, answer or None

    def state_after(self, prompt: str) -> str:
        """Where the output of `prompt` starts: 'answer' when the prompt ends by closing the reasoning (qwen3
        with enable_thinking false), 'reasoning' when it left a block open (deepseek_r1's template), else 'open'
        (a leading start tag opens one; deepseek_r1 reads an untagged output as reasoning)."""
        if prompt.rstrip().endswith(self.end):
            return "answer"
        return "reasoning" if prompt.rfind(self.start) > prompt.rfind(self.end) else "open"


_CHANNEL, _MESSAGE, _START = "<|channel|>", "<|message|>", "<|start|>"
_ENDS = ("<|end|>", "<|return|>", "<|call|>")  # what ends a harmony message


@dataclass(frozen=True)
class HarmonyParser:
    """gpt-oss's harmony format (see the module doc): the same interface as ReasoningParser."""
    name: str = "openai_gptoss"
    end: str = _CHANNEL + "final" + _MESSAGE  # where the answer starts (a grammar starts after it)
    keep_special_tokens = True

    def stream(self, prompt: str = "") -> "HarmonyStream":
        return HarmonyStream(prompt)

    def split(self, text: str, prompt: str = "") -> tuple[Optional[str], Optional[str]]:
        reasoning, answer = self.stream(prompt).feed(text, last=True)
        return reasoning or None, answer or None

    def state_after(self, prompt: str) -> str:
        """'reasoning' or 'answer' where the prompt ends inside an analysis or another channel's message, else
        'open' (the output starts with, or inside, a message header)."""
        body, header = _harmony_position(prompt)
        return "open" if not body else "reasoning" if _channel(header) == "analysis" else "answer"


def _harmony_position(prompt: str) -> tuple[bool, str]:
    """(whether the prompt ends inside a message body, the header of that message or the open one's text)."""
    message = prompt.rfind(_MESSAGE)
    boundary = max([prompt.rfind(t) for t in _ENDS + (_START,)])
    if message > boundary:
        return True, prompt[max(boundary, 0):message]
    return False, prompt[boundary + len(_START):] if boundary >= 0 and prompt.startswith(_START, boundary) else ""


def _channel(header: str) -> Optional[str]:
    at = header.find(_CHANNEL)
    if at < 0:
        return None
    rest = header[at + len(_CHANNEL):]
    return rest.split("<|", 1)[0].split(" ", 1)[0].strip()


class HarmonyStream:
    """Splits a harmony output as it arrives: message headers are held until their `<|message|>` names the
    channel; a body's text goes to the reasoning (analysis) or the answer as it comes, less a possible end
    marker cut by the delta boundary. An output with no harmony markup at all is answer text."""

    def __init__(self, prompt: str = "") -> None:
        self.in_body, self.header = _harmony_position(prompt)
        self.held = ""
        self.lead = len(self.header)  # the open header's text in the prompt (e.g. "assistant")
        self.harmony = False  # a message body seen in the output (else plain text is the answer)

    def feed(self, delta: str, last: bool = False) -> tuple[str, str]:
        text, self.held = self.held + delta, ""
        out = {True: [], False: []}  # reasoning?: parts
        while text:
            if not self.in_body:  # (the marker may straddle deltas: look in the whole header)
                self.header += text
                at = self.header.find(_MESSAGE)
                if at < 0:
                    break
                text, self.header = self.header[at + len(_MESSAGE):], self.header[:at]
                self.in_body = self.harmony = True
                continue
            analysis = _channel(self.header) == "analysis"
            ends = [(text.find(t), t) for t in _ENDS if t in text]
            if not ends:  # the body goes on: all of it out, less what may be the start of an end marker
                keep = max(_partial_suffix(text, t) for t in _ENDS)
                out[analysis].append(text[:len(text) - keep])
                self.held = text[len(text) - keep:]
                break
            at, marker = min(ends)
            out[analysis].append(text[:at])
            self.in_body, self.header, text = False, "", text[at + len(marker):]
        if last:
            self._finish(out)
        return "".join(out[True]), "".join(out[False])

    def _finish(self, out: dict) -> None:
        held, self.held = self.held, ""
        if self.in_body:
            out[_channel(self.header) == "analysis"].append(held)
        elif not self.harmony and "<|" not in self.header[self.lead:]:
            out[False].append(self.header[self.lead:])  # no harmony markup at all: plain answer text
        self.header = ""


AnyReasoningParser = Union[ReasoningParser, HarmonyParser]
PARSERS: dict[str, AnyReasoningParser] = {
    p.name: p for p in (ReasoningParser("qwen3", starts_in_reasoning=False),
                        ReasoningParser("deepseek_r1", starts_in_reasoning=True), HarmonyParser())}


def get_parser(name: Optional[str]) -> Optional[AnyReasoningParser]:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown --reasoning-parser {name!r}; choose one of {', '.join(PARSERS)}")
    return PARSERS[name]


class ReasoningStream:
    """Splits an output as it arrives: feed(delta) -> (reasoning delta, answer delta). A possible tag cut by a
    delta boundary is held back until the next delta shows what it is (finish() lets it out)."""

    def __init__(self, parser: ReasoningParser, prompt: str = "") -> None:
        self.p = parser
        self.state = parser.state_after(prompt)  # "open" (a leading start tag may come), "reasoning", "answer"
        self.held = ""

    def feed(self, delta: str, last: bool = False) -> tuple[str, str]:
        """(reasoning, answer) of one delta; `last`: the output ends with it (what was held back comes out)."""
        reasoning, answer = self._feed(delta)
        if last:
            more_reasoning, more_answer = self.finish()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        return reasoning, answer

    def _feed(self, delta: str) -> tuple[str, str]:
        text, self.held = self.held + delta, ""
        reasoning, answer = [], []
        while text:
            if self.state == "open":
                if self.p.start.startswith(text):  # still possibly the opening tag
                    self.held = text
                    break
                opened = text.startswith(self.p.start)
                if opened:
                    text = text[len(self.p.start):]
                self.state = "reasoning" if opened or self.p.starts_in_reasoning else "answer"
            elif self.state == "reasoning":
                text = self._reasoning(text, reasoning)
            else:
                answer.append(text)
                text = ""
        return "".join(reasoning), "".join(answer)

    def _reasoning(self, text: str, out: list[str]) -> str:
        """Emit reasoning up to the closing tag (or up to a possible start of it); returns what follows it."""
        end = text.find(self.p.end)
        if end >= 0:
            out.append(text[:end])
            self.state = "answer"
            return text[end + len(self.p.end):]
        keep = _partial_suffix(text, self.p.end)
        out.append(text[:len(text) - keep])
        self.held = text[len(text) - keep:]
        return ""

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended."""
        held, self.held = self.held, ""
        if self.state == "reasoning" or (self.state == "open" and self.p.starts_in_reasoning):
            return held, ""
        if self.state == "open" and held == self.p.start:  # an output of just the opening tag
            return "", ""
        return "", held


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
