"""Continuous batching with chunked prefill, FCFS or priority scheduling, preemption by recompute.

Each step hands out a token budget (max_num_batched_tokens): running requests first (decodes and
unfinished prefill chunks, oldest first), then waiting requests in arrival order. A request's next chunk
is just "tokens it has minus tokens with KV", so prefill chunks and decodes are the same thing to it.
When blocks run out the newest running request is preempted: its blocks are freed and it goes back to
the front of the waiting queue, to be recomputed (prefix cache permitting, cheaply).

--scheduling-policy priority (engine/request_queue.py): "oldest first" and "newest" above become best and worst
rank (priority, then arrival). Running requests take the budget in rank order and waiting ones are admitted in
rank order; when a waiting request cannot start (no blocks, or --max-num-seqs running) while a running one
ranks below it, that one is preempted for it, so a high-priority request does not wait for low-priority work
to finish; and while it waits, running requests ranked below it decode but run no prefill chunk, and no
request of a lower priority is admitted in the step that admits it, so that its prefill has the step's budget
and the step is no longer than that prefill needs.

KV groups (step/kv_groups.py): a request has a block list per group of layers; after each step, sliding-window
groups give back the blocks no later query can see (update), and allocation counts the blocks every group needs.

Speculative decoding: a decoding request with pending drafts runs them after its last token (k + 1 query
tokens, under the same budget); their slots are allocated like any other (plus lookahead slots a
KV-keeping drafter writes ahead), but only verified tokens ever enter the prefix cache. After the step the
accepted tokens are appended one by one (a stop token or max_tokens ends the request there) and the
rejected drafts' slots are rolled back by lowering num_computed_tokens: their KV is simply overwritten later.

Structured output: a constrained request waits in `compiling` (others run) until its grammar is compiled in
the background, then joins the waiting queue; one that does not compile fails alone (REJECTED). Each of its
sampled rows carries the grammar's token bitmask, and update() advances its matcher.

Failure isolation: when the worker raises on a step, the engine core calls roll_back(): the step's requests
go back to the head of the waiting queue (their blocks freed, uncomputed blocks dropped from the prefix
cache) and into `quarantine`, where they run one at a time until each has sampled a token; one that fails
alone is finished with ERROR. No request's data can end the engine for the others.

KV tiers (a KV connector, tokenmill/kv_transfer): after the device prefix hit, the connector is asked how many
more leading tokens it holds. Those get device blocks like new tokens, but count as computed: the worker
copies them in before the forward pass. When they must first come from a slow tier (disk) or another
instance (a decode instance pulling a prompt's KV from the prefill instance), the request steps aside into
`loading` (others run) and is looked up again once the connector says it is ready; a pulled prompt may come
with its first output token (the prefill instance's sample), emitted as if sampled here right after the
update that reported the pull, so that the request's first step decodes from it. A connector may also keep
a finished request's blocks out of the pool (`held`: a prefill instance until the decode instance has pulled
them); it names the requests whose blocks may go back, polled at the start of each step.

Images (a vision-language model): the worker encodes an image in the step of the chunk that first reaches its
placeholder tokens. Those encodings share an encoder budget per step of max_num_batched_tokens image tokens
(_fit_encoder): a chunk stops before an image that would exceed it, unless the step has encoded nothing yet.

--task embed (engine/pooling.py): a request finishes with its pooled vector as soon as its prompt has run; with
an encoder or a mean/CLS pooler its prompt is admitted only whole (never chunked).
"""
from __future__ import annotations

import logging
from typing import Iterable, Optional

from tokenmill.config import EngineConfig
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request_queue import WaitingQueue, rank
from tokenmill.messages import EngineCoreOutput, FinishReason, Request, RequestStatus, check_fits
from tokenmill.kv_transfer.base import KVConnectorScheduler
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.controller import SpecController
from tokenmill.step import NewRequest, ScheduledRequest, SchedulerOutput
from tokenmill.step.kv_groups import kv_layout
from tokenmill.structured import StructuredOutputManager

logger = logging.getLogger("tokenmill")


def _prompt_tokens(req: Request, start: int, n: int) -> int:
    """How many of the n known tokens from position start are req's prompt tokens."""
    return max(min(start + n, req.num_prompt_tokens) - start, 0)


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, connector: Optional[KVConnectorScheduler] = None) -> None:
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.max_model_len = config.model.max_model_len
        self.block_size = config.cache.block_size
        # --task embed: a request finishes with its pooled vector once its prompt has run (no decode); an
        # encoder's or a mean/CLS pooler's prompt runs whole in one step (never chunked)
        self.pooler = config.model.pooler
        self.whole_prompts = self.pooler is not None and self.pooler.whole_prompt
        self.encoder_left = 0  # this step's encoder budget left (image tokens; _fit_encoder)
        self.connector = connector
        self.kv_layout = kv_layout(config)  # the layers' KV groups (the workers compute the same)
        self.kv = KVCacheManager(num_blocks, self.block_size, config.cache.enable_prefix_caching,
                                 connector.on_evict if connector is not None else None, self.kv_layout.windows)
        self.waiting = WaitingQueue(config.scheduler.scheduling_policy)
        self.by_priority = self.waiting.by_priority
        self.loading: list[Request] = []  # waiting for a KV connector's background transfers
        self.compiling: list[Request] = []  # waiting for their grammar to compile
        self.structured = StructuredOutputManager(config.model.tokenizer, config.model.hf_config.vocab_size)
        self.pending: list[EngineCoreOutput] = []  # requests finished between steps (aborts, failures)
        self.held: dict[str, Request] = {}  # finished, blocks kept for a KV connector (sent to another instance)
        self.quarantine: list[str] = []  # requests of a failed step, run alone until each samples a token
        self.running: list[Request] = []
        # Scheduled in a step whose result has not come back (pipeline parallel keeps several steps in
        # flight): not scheduled again, never preempted, and their blocks freed only once back.
        self.in_flight: set[str] = set()
        self._free_when_back: list[Request] = []
        self.pipeline_depth = config.parallel.pipeline_parallel_size  # steps the engine keeps in flight
        self.max_loras = config.lora.max_loras if config.lora is not None else 0  # distinct adapters running
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        # Prompt tokens the model ran (not found in a cache or supplied by a connector; again after a preemption)
        self.num_prompt_tokens_computed = 0
        self.num_interrupted_steps = 0  # steps cut short for a better-ranked arrival (take_back)
        spec = config.speculative
        self.spec = SpecController(spec.k, spec.disable_by_batch_size, spec.adaptive) if spec else None
        self.spec_lookahead = bool(spec and spec.needs_kv)   # drafter writes KV up to k slots ahead
        self.drafts: dict[str, list[int]] = {}                # request id -> drafts for its next step

    # -- admission --------------------------------------------------------------------------
    def check_fits(self, prompt_len: int, sp: SamplingParams) -> None:
        check_fits(prompt_len, sp, self.max_model_len, self.block_size, self.kv.num_usable_blocks,
                   self.pooler is not None, self.blocks_for)

    def blocks_for(self, num_tokens: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once (over all its KV groups)."""
        return self.kv_layout.max_blocks(num_tokens, self.block_size, self.max_num_batched_tokens)

    def add_request(self, request: Request) -> None:
        """Raises ValueError (nothing queued) if the request's grammar cannot even start compiling."""
        so = request.sampling_params.structured_outputs
        if so is not None:
            self.structured.submit(so)
        self.requests[request.request_id] = request
        if so is not None:
            self.compiling.append(request)
        else:
            self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.fail(req, FinishReason.ABORT)

    def fail(self, req: Request, reason: FinishReason, error: Optional[str] = None) -> None:
        """Finish req between steps (abort, rejection, error); its notice is in take_pending()."""
        req.finish_reason = reason
        out = self._finish(req)
        out.error = error
        self.pending.append(out)

    def take_pending(self) -> list[EngineCoreOutput]:
        out, self.pending = self.pending, []
        return out

    def _finish(self, req: Request) -> EngineCoreOutput:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            for queue in (self.waiting, self.loading, self.compiling):
                if req in queue:
                    queue.remove(req)
                    break
        req.status = RequestStatus.FINISHED
        hold, params = False, None
        if self.connector is not None and req.request_id not in self.in_flight:
            hold, params = self.connector.request_finished(req, self.kv.block_ids(req.request_id))
        if hold:  # the connector gives them back through take_freeable()
            self.held[req.request_id] = req
        elif req.request_id in self.in_flight:  # a step in flight still writes its KV
            self._free_when_back.append(req)
        else:
            self.kv.free(req)
        if self.connector is not None:
            self.connector.release(req)
        self.drafts.pop(req.request_id, None)
        self.structured.free(req.request_id)
        if req.request_id in self.quarantine:
            self.quarantine.remove(req.request_id)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
        return EngineCoreOutput(req.request_id, [], finish_reason=int(req.finish_reason),
                                stop_reason=req.stop_reason, num_cached_tokens=max(req.num_cached_tokens, 0),
                                kv_transfer_params=params)

    def _free_held(self) -> None:
        for rid in self.connector.take_freeable():
            req = self.held.pop(rid, None)
            if req is not None:
                self.kv.free(req)

    def has_unfinished(self) -> bool:
        """Also while blocks are held for a connector: the engine keeps stepping until they are given back."""
        return bool(self.requests) or bool(self.pending) or bool(self.held)

    def _admit_compiled(self) -> None:
        """Constrained requests whose grammar is ready join the waiting queue; those whose grammar failed
        to compile finish alone (REJECTED). With nothing else to run, wait a moment for a compile."""
        if not (self.running or self.waiting or self.loading):
            self.structured.wait(0.05)
        for req in list(self.compiling):
            try:
                ready = self.structured.ready(req.sampling_params.structured_outputs)
            except ValueError as e:
                self.fail(req, FinishReason.REJECTED, str(e))
                continue
            if ready:
                self.compiling.remove(req)
                self.waiting.add(req)

    # -- failure isolation --------------------------------------------------------------------
    def roll_back(self, sched: SchedulerOutput, error: str) -> None:
        """The worker raised on `sched`. A request that ran alone is the culprit: it finishes with ERROR.
        Otherwise every request of the step goes back to the head of the waiting queue, to be run alone
        (quarantine). Blocks allocated for the step are freed and those it would have filled are dropped
        from the prefix cache: their KV was never (fully) written."""
        self._back(sched)
        if len(sched.scheduled) == 1:
            req = self.requests.get(sched.scheduled[0].request_id)
            if req is not None:
                self.fail(req, FinishReason.ERROR, error)
            return
        for s in reversed(sched.scheduled):
            req = self.requests.get(s.request_id)
            if req is None:
                continue
            self._readmit(req, s)
            if req.request_id not in self.quarantine:
                self.quarantine.insert(0, req.request_id)

    def take_back(self, sched: SchedulerOutput) -> None:
        """The worker cut `sched` short (a better-ranked arrival, step/interrupt.py): none of its tokens count
        as computed. A running request goes back to where the step started and keeps its blocks (the worker's
        copy has the step's deltas, which stay true); one admitted in this step is admitted again later, since
        its prefix hit may be blocks the step was to fill. Blocks the step would have filled leave the prefix
        cache."""
        self._back(sched)
        self.num_interrupted_steps += 1
        for s in reversed(sched.scheduled):
            req = self.requests.get(s.request_id)
            if req is None or req.status != RequestStatus.RUNNING:  # aborted during the step
                continue
            self.num_prompt_tokens_computed -= _prompt_tokens(req, s.start_pos, len(s.token_ids) - s.num_spec)
            if s.new:
                self._readmit(req, s)
                continue
            self.kv.uncache(req, s.start_pos)
            req.num_computed_tokens = s.start_pos
            req.num_prompt_logprobs_done = min(req.num_prompt_logprobs_done, s.prompt_logprobs_from)

    def _readmit(self, req: Request, s: ScheduledRequest) -> None:
        """A request of a step that did not complete back to the head of the waiting queue, its blocks freed."""
        self.kv.free(req, uncache_from=s.start_pos)
        self.drafts.pop(req.request_id, None)
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_prompt_logprobs_done = min(req.num_prompt_logprobs_done, s.prompt_logprobs_from)
        self.waiting.requeue(req)

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = []
        if self.connector is not None:
            self._free_held()
        if self.loading:
            self._resume_loaded()
        if self.compiling:
            self._admit_compiled()
        suspect = self.quarantine[0] if self.quarantine else None  # run alone: only it is scheduled
        budget = self.encoder_left = self.max_num_batched_tokens
        if self.spec is not None:  # the batch this step will (about) have
            batch = len(self.running) + min(len(self.waiting), max(self.max_num_seqs - len(self.running), 0))
            k = self.spec.choose_k(batch)
        else:
            k = 0
        out.spec_k = k
        chosen: list[tuple[Request, int, list[int], bool]] = []  # (request, known tokens to run, drafts, new)
        budget, victims = self._schedule_running(chosen, budget, k, suspect, out)
        if suspect is not None and not chosen:  # a suspect waiting anywhere goes first
            req = self.requests[suspect]
            if req in self.waiting:
                self.waiting.to_front(req)
        # No admission in a step that had to preempt running requests for KV room, except (priority policy) of a
        # request ranked above every one it preempted: a high-priority arrival does not wait behind a low one's room.
        if not victims or self.by_priority:
            self._schedule_waiting(chosen, budget, k, suspect, out,
                                   min((v.priority for v in victims), default=None))

        for req, n, drafts, new in chosen:
            out.scheduled.append(self._scheduled(req, n, drafts, new, k, out))
            self.in_flight.add(req.request_id)
            self.num_prompt_tokens_computed += _prompt_tokens(req, req.num_computed_tokens, n)
            req.num_computed_tokens += n + len(drafts)
            self.drafts.pop(req.request_id, None)
            out.num_batched_tokens += n + len(drafts)
            out.num_draft_tokens += len(drafts)
            out.num_decodes += n == 1 and out.scheduled[-1].sample
            if self.connector is not None and out.scheduled[-1].sample and req.num_output_tokens == 0:
                self.connector.on_prompt_scheduled(req, self.kv.block_ids(req.request_id))
        if self.connector is not None:
            out.kv_connector_plan = self.connector.build_plan()
        return out

    def _schedule_running(self, chosen: list, budget: int, k: int, suspect: Optional[str],
                          out: SchedulerOutput) -> tuple[int, list[Request]]:
        """Running requests first, oldest first (preempting the newest when blocks run out); returns the budget
        left and the requests preempted. Pipeline parallel spreads them over the steps in flight, so that each
        stage has a share."""
        per_step = -(-len(self.running) // self.pipeline_depth)
        yield_to = self._yield_priority()
        victims: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if (suspect is not None and req.request_id != suspect) or req.request_id in self.in_flight or (
                    yield_to is not None and req.priority > yield_to):
                i += 1
                continue
            n = self._fit_encoder(req, req.num_computed_tokens, min(req.num_tokens - req.num_computed_tokens, budget))
            if n == 0:  # its next image waits for the next step's encoder budget
                i += 1
                continue
            drafts = self._drafts_to_verify(req, n, budget, k)
            lookahead = self._lookahead(req, req.num_computed_tokens + n, k)
            ok = self.kv.allocate_slots(req, n + len(drafts), num_lookahead_tokens=lookahead)
            if not ok and (drafts or lookahead):  # speculation is optional: drop it before preempting anyone
                drafts, lookahead = [], 0
                ok = self.kv.allocate_slots(req, n)
            while not ok:
                victim = self._preemptible()
                if victim is None:
                    break
                self._preempt(victim)
                out.num_preempted += 1
                victims.append(victim)
                if victim is req:
                    break
                ok = self.kv.allocate_slots(req, n)
            if not ok:
                break
            chosen.append((req, n, drafts, False))
            budget -= n + len(drafts)
            i += 1
            if len(chosen) >= per_step:
                break
        return budget, victims

    def _yield_priority(self) -> Optional[int]:
        """Priority policy: the best priority value with a prompt to run, the waiting head's (when it is a
        base-model request: an adapter's may wait for a slot, which lower-priority requests must not wait on in
        turn) or a running request's still prefilling. Running requests of a worse priority sit this step out,
        decodes too: that prompt gets the budget and a step no longer than its own prefill needs, so a
        high-priority TTFT does not pay for the low-priority batch. The running requests are put in rank order
        here. None under fcfs or with no prompt to run."""
        if not self.by_priority:
            return None
        self.running.sort(key=rank)
        prompts = [r.priority for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        if self.waiting and not self.waiting.peek().lora_int_id:
            prompts.append(self.waiting.peek().priority)
        return min(prompts, default=None)

    def _schedule_waiting(self, chosen: list, budget: int, k: int, suspect: Optional[str],
                          out: SchedulerOutput, below: Optional[int]) -> None:
        """Then waiting requests in arrival (or rank) order, their prefix-cache (and lower-tier) hit counted as
        computed; with `below`, only those of a better priority value. A request whose adapter would be one more
        than --max-loras among the running ones keeps its place and waits (the worker has max_loras adapter slots;
        the running requests' adapters hold them).
        Later requests for adapters wait behind it too, so that the running adapters drain and it gets a slot
        rather than starve; base-model requests, which hold no slot, go ahead."""
        loras = {r.lora_int_id for r in self.running} - {0}
        skipped: list[Request] = []
        best = None  # priority policy: the best priority admitted this step; worse ones wait for the next
        while self.waiting and budget > 0:
            req = self.waiting.peek()
            if (suspect is not None and (req.request_id != suspect or chosen)) or (
                    best is not None and req.priority > best) or (below is not None and req.priority >= below):
                break
            if req.lora_int_id and (skipped or (req.lora_int_id not in loras and len(loras) >= self.max_loras)):
                skipped.append(self.waiting.pop())
                continue
            if len(self.running) >= self.max_num_seqs:
                freed = self._preempt_for(req, chosen, out)
                if freed is None:
                    break
                budget += freed
                continue
            hits, num_hit = self.kv.get_computed_blocks(req)
            num_ext = 0  # tokens after the device hit that a lower tier supplies
            if self.connector is not None and self.kv.reuses_cache(req):
                ext = self.connector.lookup(req, num_hit)
                if not ext.ready:
                    self.loading.append(self.waiting.pop())
                    continue
                num_ext = ext.num_tokens
            n = self._fit_encoder(req, num_hit + num_ext, min(req.num_tokens - num_hit - num_ext, budget), True)
            if n == 0 or (self.whole_prompts and n < req.num_tokens - num_hit - num_ext):
                break  # next step: it runs whole or not at all, or its image gets the encoder budget
            lookahead = self._lookahead(req, num_hit + num_ext + n, k)
            if not self.kv.allocate_slots(req, num_ext + n, hits, num_lookahead_tokens=lookahead):
                if not lookahead or not self.kv.allocate_slots(req, num_ext + n, hits):
                    freed = self._preempt_for(req, chosen, out)
                    if freed is None:
                        break
                    budget += freed
                    continue
            self._admit(self.waiting.pop(), num_hit, num_ext)
            chosen.append((req, n, [], True))
            budget -= n
            if req.lora_int_id:
                loras.add(req.lora_int_id)
            if self.by_priority:
                best = req.priority if best is None else min(best, req.priority)
        self.waiting.put_back(skipped)

    def _admit(self, req: Request, num_hit: int, num_ext: int) -> None:
        """req (its blocks allocated) runs from its device hit of num_hit tokens and num_ext a lower tier supplies."""
        if self.connector is not None:
            first = num_hit // self.block_size  # the external hit may end inside a block (the prompt's last)
            self.connector.on_allocated(req, self.kv.block_ids(req.request_id, first)[:-(-num_ext // self.block_size)])
            self.kv.record_lookup(req.num_tokens, num_hit, num_ext)
        else:
            self.kv.record_lookup(req.num_tokens, num_hit)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit + num_ext
        req.num_computed_tokens = num_hit + num_ext
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _fit_encoder(self, req: Request, start: int, n: int, admitted: bool = False) -> int:
        """How many of the chunk's n tokens from `start` fit this step's encoder budget: the images it reaches
        first (on admission, an image the prefix hit ends inside is not encoded yet either) spend it; the chunk
        stops before one that would overspend it, unless nothing was encoded this step (an image larger than the
        budget runs alone)."""
        for img in req.mm_inputs:
            if img.offset >= start + n or img.end <= start or (img.offset < start and not admitted):
                continue
            if img.num_tokens > self.encoder_left and self.encoder_left < self.max_num_batched_tokens:
                return max(img.offset - start, 0)
            self.encoder_left -= img.num_tokens
        return n

    def _scheduled(self, req: Request, n: int, drafts: list[int], new: bool, k: int,
                   out: SchedulerOutput) -> ScheduledRequest:
        """req's step message: n known tokens then the drafts, as a delta on the worker's copy of req (a
        NewRequest in `out` first when it was just admitted)."""
        start, sp = req.num_computed_tokens, req.sampling_params
        if new:
            out.new_requests.append(NewRequest(req.request_id, req.prompt_token_ids, sp, req.eos_token_ids,
                                               req.output_token_ids, req.lora_request, req.mm_inputs))
            req.num_blocks_sent = req.num_outputs_sent = 0
        new_blocks = self.kv.new_block_ids(req.request_id, req.num_blocks_sent)  # per KV group, as many each
        new_outputs = req.all_token_ids[req.num_prompt_tokens + req.num_outputs_sent:] if not new else []
        req.num_blocks_sent += len(new_blocks[0]) if new_blocks else 0
        req.num_outputs_sent = req.num_output_tokens
        sample = start + n == req.num_tokens
        bitmask = None
        if sample and sp.structured_outputs is not None:
            mask = self.structured.bitmask(req.request_id, sp.structured_outputs)
            bitmask = None if mask is None else mask.numpy().tobytes()
        plp_from = req.num_prompt_logprobs_done
        if sp.prompt_logprobs is not None:
            req.num_prompt_logprobs_done = max(plp_from, min(start + n, req.num_prompt_tokens - 1))
        return ScheduledRequest(
            request_id=req.request_id, token_ids=req.all_token_ids[start:start + n] + drafts, start_pos=start,
            new_block_ids=new_blocks, new_output_token_ids=new_outputs, sample=sample, prompt_logprobs_from=plp_from,
            num_spec=len(drafts),
            num_propose=k if (sample and self._may_speculate(req) and req.max_tokens - req.num_output_tokens > 2)
            else 0,
            next_token=req.all_token_ids[start + n] if (self.spec is not None and not sample) else None,
            new=new, token_bitmask=bitmask)

    def _take_first_tokens(self) -> list[EngineCoreOutput]:
        """Loading requests whose whole prompt's KV has arrived with their first output token (a decode instance
        takes the prefill instance's sample): each token is emitted at once, as if sampled here (stop-checked,
        fed to the grammar); the request's next step runs it at position prompt_len. One it ends (EOS, a stop
        token, max_tokens 1) finishes here, with no step and no blocks."""
        outs = []
        for req in list(self.loading):
            token = self.connector.first_token(req)
            if token is None:
                continue
            req.append_token(token)
            so = req.sampling_params.structured_outputs
            if so is not None:
                self.structured.accept(req.request_id, [token], so)
            out = EngineCoreOutput(req.request_id, [token], num_cached_tokens=req.num_prompt_tokens)
            if req.check_stop():
                fin = self._finish(req)
                out.finish_reason, out.stop_reason = fin.finish_reason, fin.stop_reason
            outs.append(out)
        return outs

    def _resume_loaded(self) -> None:
        """Requests whose background KV transfers finished go back to the head of the queue, in order."""
        ready = [r for r in self.loading if self.connector.is_ready(r)]
        for req in reversed(ready):
            self.loading.remove(req)
            self.waiting.requeue(req)

    # -- speculation ------------------------------------------------------------------------
    def _may_speculate(self, req: Request) -> bool:
        """Drafts are verified per position with one sampling state per request: penalties (which change
        with every accepted token) and grammars (whose state does) are not supported, so those requests
        decode normally, side by side with speculating ones."""
        sp = req.sampling_params
        return (self.spec is not None and sp.structured_outputs is None and sp.repetition_penalty == 1.0
                and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0)

    def _drafts_to_verify(self, req: Request, n: int, budget: int, k: int) -> list[int]:
        drafts = self.drafts.get(req.request_id)
        if not k or not drafts or req.num_tokens - req.num_computed_tokens != 1 or n != 1:
            return []
        # Never emit past max_tokens or the context (k drafts emit up to k + 1 tokens).
        room = min(k, budget - n, req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens)
        return drafts[:max(room, 0)]

    def _lookahead(self, req: Request, end: int, k: int) -> int:
        """Slots a KV-keeping drafter may write past this step's tokens (ending at `end`) when it samples."""
        if not (k and self.spec_lookahead and end == req.num_tokens and self._may_speculate(req)):
            return 0
        return max(0, min(k, self.max_model_len - req.num_tokens))

    def _preemptible(self) -> Optional[Request]:
        """The newest (priority policy: worst-ranked) running request not in flight, removed from running; or
        None."""
        candidates = [r for r in self.running if r.request_id not in self.in_flight]
        if not candidates:
            return None
        victim = max(candidates, key=rank) if self.by_priority else candidates[-1]
        self.running.remove(victim)
        return victim

    def _preempt_for(self, req: Request, chosen: list, out: SchedulerOutput) -> Optional[int]:
        """Priority policy: the waiting `req` cannot start; preempt the worst-ranked running request if it ranks
        below req (taking it out of this step if it was chosen). Returns the step budget that gives back, or None
        when nothing ranks below req (or under fcfs)."""
        if not self.by_priority:
            return None
        candidates = [r for r in self.running if r.request_id not in self.in_flight]
        victim = max(candidates, key=rank, default=None)
        if victim is None or rank(victim) <= rank(req):
            return None
        freed = 0
        for i, (r, n, drafts, _new) in enumerate(chosen):
            if r is victim:
                freed = n + len(drafts)
                del chosen[i]
                break
        self.running.remove(victim)
        self._preempt(victim)
        out.num_preempted += 1
        return freed

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self.drafts.pop(req.request_id, None)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.requeue(req)
        logger.debug("preempted %s (KV cache full)", req.request_id)

    # -- after the forward pass ---------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result, step_seconds: float = 0.0) -> list[EngineCoreOutput]:
        """Fold a ModelRunnerOutput into the requests: append new tokens (up to a stop), roll back rejected
        drafts, keep the next drafts."""
        outs: list[EngineCoreOutput] = []
        self._back(sched)
        if self.connector is not None:  # first: a request finishing below may need what the worker reported
            self.connector.update(result.kv_connector_output)
            if self.loading:
                outs += self._take_first_tokens()
        for s in sched.scheduled:
            req = self.requests.get(s.request_id)
            if req is None:
                continue
            pooled = result.pooled.get(s.request_id)
            if pooled is not None:  # --task embed: its prompt has run; that is all it does
                req.finish_reason = FinishReason.STOP
                out = self._finish(req)
                out.pooled = pooled
                outs.append(out)
                continue
            plp = result.prompt_logprobs.get(s.request_id)
            tokens = result.sampled.get(s.request_id)
            if tokens is None:
                if plp:  # a prefill chunk that does not sample still reports its prompt logprobs
                    outs.append(EngineCoreOutput(req.request_id, [], new_prompt_logprobs=plp))
                continue
            if s.num_spec:
                accepted = len(tokens) - 1
                req.num_computed_tokens -= s.num_spec - accepted  # the rejected drafts' KV is stale
                self.spec.observe_round(s.num_spec, accepted)
            if s.token_bitmask is not None:
                self.structured.accept(req.request_id, tokens, req.sampling_params.structured_outputs)
            if self.quarantine and self.quarantine[0] == req.request_id:
                self.quarantine.pop(0)  # it ran alone and sampled: it is not the culprit
            lps = result.logprobs.get(s.request_id)
            done = False
            emitted = 0
            for t in tokens:
                req.append_token(t)
                emitted += 1
                done = req.check_stop()
                if done:
                    break
            out = EngineCoreOutput(req.request_id, tokens[:emitted], new_logprobs=lps[:emitted] if lps else None,
                                   new_prompt_logprobs=plp, num_cached_tokens=max(req.num_cached_tokens, 0))
            if done:
                fin = self._finish(req)
                out.finish_reason, out.stop_reason = fin.finish_reason, fin.stop_reason
                out.kv_transfer_params = fin.kv_transfer_params
            elif self.spec is not None and s.request_id in result.spec_token_ids:
                self.drafts[s.request_id] = result.spec_token_ids[s.request_id]
            outs.append(out)
        if self.spec is not None and sched.scheduled:
            self.spec.observe_step(sched.num_batched_tokens, sched.num_decodes, sched.spec_k,
                                   sched.num_draft_tokens, step_seconds)
        if self.kv_layout.frees_blocks:
            self._free_out_of_window(sched)
        return outs

    def _free_out_of_window(self, sched: SchedulerOutput) -> None:
        """The step's requests that run on give back the blocks of sliding-window layers that no later query
        sees (num_computed_tokens is final now: rejected drafts are rolled back)."""
        for s in sched.scheduled:
            req = self.requests.get(s.request_id)
            if req is not None and req.status == RequestStatus.RUNNING:
                self.kv.free_out_of_window(req)

    def _back(self, sched: SchedulerOutput) -> None:
        """sched's result is in: its requests may be scheduled again, and those that finished meanwhile
        give back their blocks."""
        self.in_flight.difference_update(s.request_id for s in sched.scheduled)
        if self._free_when_back:
            back = [r for r in self._free_when_back if r.request_id not in self.in_flight]
            for req in back:
                self.kv.free(req)
                self._free_when_back.remove(req)

    # -- stats ------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.loading) + len(self.compiling)
