"""Front-side processing of engine outputs: incremental detokenization, stop strings, logprobs,
and the fan-in of n>1 samples. Runs in the API process (or the offline LLM), never in the engine loop.

RequestState is the front's one record of a user request: its samples, what was sent of them, and (in the API
process) the queue its outputs go to and the times its metrics and the dashboard read."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Optional

from tokenmill.messages import EngineCoreOutput, FinishReason, PositionLogprobs
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Emits text as tokens arrive. Decodes a short window of ids and emits only the part past what was
    already emitted, holding back while the window ends in an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool) -> None:
        self.tok = tokenizer
        self.ids = list(prompt_ids[-6:])  # a little prompt context gets leading spaces right
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.kw = dict(skip_special_tokens=skip_special_tokens)
        if not spaces_between_special_tokens:
            self.kw["spaces_between_special_tokens"] = False

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, **self.kw)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""


class _SampleState:
    """One sample (one engine request) of a user request."""

    def __init__(self, index: int, engine_id: str) -> None:
        self.index = index
        self.engine_id = engine_id
        self.token_ids: list[int] = []
        self.text = ""
        self.sent_text = 0     # delta mode: chars already returned
        self.sent_tokens = 0
        self.sent_logprobs = 0
        self.logprobs: Optional[list[dict[int, Logprob]]] = None
        self.cumulative_logprob: Optional[float] = None
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.final_sent = False
        self.detok: Optional[IncrementalDetokenizer] = None


@dataclass
class RequestTimes:
    """When a request's events happened (monotonic seconds; *_wall: wall clock, for --enable-request-timing):
    arrival, first scheduled (engine side), first and last token seen here, each output's (time, new tokens),
    and the time spent detokenizing steps that carried this request's tokens."""
    arrival: float = field(default_factory=time.monotonic)
    arrival_wall: float = field(default_factory=time.time)
    scheduled_wall: Optional[float] = None
    first_token: Optional[float] = None
    first_token_wall: Optional[float] = None
    last_token: Optional[float] = None
    token_times: list[tuple[float, int]] = field(default_factory=list)  # the dashboard's per-request view
    detokenize_s: float = 0.0

    def on_tokens(self, now: float, now_wall: float, n_new: int) -> None:
        if self.first_token is None:
            self.first_token, self.first_token_wall = now, now_wall
        self.last_token = now
        self.token_times.append((now, n_new))

    def timing(self, now_wall: float) -> dict[str, float]:
        """Server-side seconds of a finished request: queue (arrival -> first scheduled), prefill (-> first
        token here), decode (-> finished), detokenize (incremental detokenization, within prefill and decode),
        total (arrival -> finished)."""
        scheduled = self.scheduled_wall if self.scheduled_wall is not None else now_wall
        first = self.first_token_wall if self.first_token_wall is not None else now_wall
        return {"queue": max(scheduled - self.arrival_wall, 0.0), "prefill": max(first - scheduled, 0.0),
                "decode": max(now_wall - first, 0.0), "detokenize": self.detokenize_s,
                "total": max(now_wall - self.arrival_wall, 0.0)}


class RequestState:
    def __init__(self, request_id: str, prompt: Optional[str], prompt_ids: list[int], params: SamplingParams,
                 tokenizer, delta: bool, queue: Optional[asyncio.Queue] = None) -> None:
        """queue (AsyncLLM): where this request's outputs (or the exception that ended it) go; several
        requests may share one."""
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.tok = tokenizer
        self.delta = delta
        self.samples: list[_SampleState] = []
        self.num_unfinished = 0
        # Samples with news since the last make_output: the per-output work is O(samples touched), not O(n).
        self.dirty: dict[int, _SampleState] = {}
        self.prompt_logprobs: Optional[list] = [None] if params.prompt_logprobs is not None else None
        self.sent_prompt_logprobs = False
        self.num_cached_tokens = 0
        self.kv_transfer_params: Optional[dict] = None  # reported with the finished output
        self.embedding: Optional[bytes] = None  # --task embed: the pooled vector, reported when finished
        self.queue = queue
        self.times = RequestTimes()

    def add_sample(self, index: int, engine_id: str) -> None:
        s = _SampleState(index, engine_id)
        if self.params.logprobs is not None:
            s.logprobs, s.cumulative_logprob = [], 0.0
        if self.tok is not None and self.params.detokenize:
            s.detok = IncrementalDetokenizer(self.tok, self.prompt_ids, self.params.skip_special_tokens,
                                             self.params.spaces_between_special_tokens)
        self.samples.append(s)
        self.num_unfinished += 1

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    @property
    def engine_ids(self) -> list[str]:
        return [s.engine_id for s in self.samples]

    @property
    def num_generation_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    @property
    def finish_reasons(self) -> list[str]:
        """Of the samples finished so far (n > 1: one each)."""
        return [s.finish_reason for s in self.samples if s.finish_reason is not None]

    def _decoded(self, token_id: int) -> Optional[str]:
        return self.tok.decode([token_id]) if self.tok is not None else None

    def _logprob_dict(self, entry: PositionLogprobs) -> dict[int, Logprob]:
        ids, lps, rank = entry
        d = {ids[0]: Logprob(lps[0], rank, self._decoded(ids[0]))}
        for r, (t, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            d.setdefault(t, Logprob(lp, r, self._decoded(t)))
        return d

    def process(self, s: _SampleState, out: EngineCoreOutput) -> bool:
        """Fold one engine output into the sample. Returns True if a stop string finished it (the engine
        must then abort that request)."""
        self.num_cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        if out.pooled is not None:
            self.embedding = out.pooled
        if out.new_prompt_logprobs and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(self._logprob_dict(e) for e in out.new_prompt_logprobs)
        if s.finish_reason is not None:
            return False
        self.dirty[s.index] = s
        stopped = False
        for i, t in enumerate(out.new_token_ids):
            s.token_ids.append(t)
            if s.logprobs is not None and out.new_logprobs:
                d = self._logprob_dict(out.new_logprobs[i])
                s.logprobs.append(d)
                s.cumulative_logprob += d[t].logprob
            if s.detok is not None:
                stopped = self._add_text(s, t)
                if stopped:
                    break
        if not stopped and out.finish_reason is not None:
            s.finish_reason = str(FinishReason(out.finish_reason))
            s.stop_reason = out.stop_reason if out.error is None else out.error  # "rejected"/"error": why
        if s.finish_reason is not None:
            self.num_unfinished -= 1
        return stopped

    def _add_text(self, s: _SampleState, token_id: int) -> bool:
        new = s.detok.add(token_id)
        if not new:
            return False
        start = max(len(s.text) - self.params.max_stop_len + 1, 0)
        s.text += new
        for stop in self.params.stop:
            pos = s.text.find(stop, start)
            if pos >= 0:
                end = pos + len(stop) if self.params.include_stop_str_in_output else pos
                s.text = s.text[:end]
                s.finish_reason, s.stop_reason = "stop", stop
                return True
        return False

    def make_output(self) -> Optional[RequestOutput]:
        """Delta mode: what is new since the last call (None if nothing). Otherwise the cumulative state."""
        kv_params = self.kv_transfer_params if self.finished else None
        if not self.delta:
            return RequestOutput(self.request_id, self.prompt, self.prompt_ids,
                                 [CompletionOutput(s.index, s.text, list(s.token_ids), s.cumulative_logprob, s.logprobs,
                                                   s.finish_reason, s.stop_reason) for s in self.samples],
                                 self.finished, self.prompt_logprobs, self.num_cached_tokens,
                                 kv_transfer_params=kv_params, embedding=self.embedding)
        outs = []
        touched, self.dirty = sorted(self.dirty.items()), {}
        for _, s in touched:
            # Hold back a possible partial stop string until the sample finishes.
            hold = 0 if s.finish_reason is not None else max(self.params.max_stop_len - 1, 0)
            text_end = max(len(s.text) - hold, s.sent_text)
            text = s.text[s.sent_text:text_end]
            toks = s.token_ids[s.sent_tokens:]
            lps = s.logprobs[s.sent_logprobs:] if s.logprobs is not None else None
            if not text and not toks and s.finish_reason is None:
                continue
            if s.final_sent:
                continue
            outs.append(CompletionOutput(s.index, text, toks, s.cumulative_logprob, lps, s.finish_reason,
                                         s.stop_reason))
            s.sent_text, s.sent_tokens = text_end, len(s.token_ids)
            s.sent_logprobs = len(s.logprobs) if s.logprobs is not None else 0
            s.final_sent = s.finish_reason is not None
        # Delta mode sends prompt logprobs once, when every prompt position has arrived (a long prompt's
        # logprobs come one prefill chunk at a time).
        plp_ready = (self.prompt_logprobs is not None and not self.sent_prompt_logprobs
                     and len(self.prompt_logprobs) >= len(self.prompt_ids))
        if not outs and not plp_ready:
            return None
        self.sent_prompt_logprobs = self.sent_prompt_logprobs or plp_ready
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, outs, self.finished,
                             self.prompt_logprobs if plp_ready else None, self.num_cached_tokens,
                             kv_transfer_params=kv_params, embedding=self.embedding if self.finished else None)


class OutputProcessor:
    """Maps engine request ids (one per sample) back to user requests."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.engine_ids: dict[str, tuple[RequestState, _SampleState]] = {}

    def add_request(self, state: RequestState, engine_ids: list[str]) -> None:
        self.requests[state.request_id] = state
        for i, eid in enumerate(engine_ids):
            state.add_sample(i, eid)
            self.engine_ids[eid] = (state, state.samples[-1])

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[tuple[RequestState, RequestOutput]], list[str]]:
        """Returns ((request, its output) to deliver, engine ids to abort because a stop string ended them). A
        finished request is forgotten here: its output's pair is the last place it is seen."""
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            entry = self.engine_ids.get(out.request_id)
            if entry is None:
                continue
            state, sample = entry
            if state.process(sample, out):
                to_abort.append(out.request_id)
            if sample.finish_reason is not None:
                del self.engine_ids[out.request_id]
            touched[state.request_id] = state
        results = []
        for rid, state in touched.items():
            if not (state.delta or state.finished):  # cumulative mode reports once, at the end
                continue
            ro = state.make_output()
            if state.finished:
                del self.requests[rid]
            if ro is not None:
                results.append((state, ro))
        return results, to_abort

    def clear(self) -> None:
        """Forget every request (the engine that ran them is gone)."""
        self.requests.clear()
        self.engine_ids.clear()

    def abort(self, request_id: str) -> tuple[Optional[RequestState], list[str]]:
        """Forget a user request; returns it (None if unknown or already finished) and the engine ids the
        engine must abort."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None, []
        ids = [s.engine_id for s in state.samples if s.finish_reason is None]
        for eid in ids:
            self.engine_ids.pop(eid, None)
        return state, ids

    def request_of(self, engine_id: str) -> Optional[RequestState]:
        """The open user request that an engine request (one sample) belongs to."""
        entry = self.engine_ids.get(engine_id)
        return entry[0] if entry is not None else None
