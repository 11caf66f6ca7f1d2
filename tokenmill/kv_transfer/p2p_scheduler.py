"""Scheduler half of the transfer connector: disaggregated prefill/decode (vLLM's kv_transfer_params).

Producer (a request with {"do_remote_decode": true}): when the step that computes its last prompt token is
scheduled, the plan tells the worker to offer the prompt's blocks after that step's forward pass. When the
request finishes (STOP or LENGTH), its blocks are held, not freed, and its output carries the params a decode
instance needs: {"do_remote_prefill": true, "remote_engine_id", "remote_host", "remote_port",
"remote_request_id", "remote_block_ids", "num_tokens" (= every prompt token: the last block may be partial),
"kv_fingerprint", "first_token_id" (the token it sampled after the prompt)}. The blocks go back to the pool
when the puller says it is done, or after hold_timeout_s.

Consumer (a request carrying those params): lookup() starts a pull of the blocks it lacks beyond its own
prefix-cache hit and answers not-ready; the request waits in `loading`. Once the pull is reported, the next
lookup supplies those tokens (the hit may end inside a block) and on_allocated has the staged rows copied
into the request's device blocks. A failed, corrupt or timed-out pull supplies 0 tokens: the whole prompt is
recomputed here and this instance samples the first token itself, `kv_pull_fallbacks` goes up.
How much is pulled depends on whether the request can take the prefill instance's first token (_first_token):
- yes: every prompt token. As soon as the pull is reported intact, first_token() hands the scheduler
  first_token_id, which it emits as the request's first output; the request then starts with its prompt
  computed and that token to run, so this instance computes no prompt token at all.
- no (logprobs, min_tokens, a seeded sample, no first_token_id in the params; n > 1, whose samples the front
  sends without it: one prefill token cannot seed several samples): prompt_len - 1 tokens, and the last prompt
  token is recomputed here so that this instance samples the first token itself. Either way the output equals
  a colocated run's.

Safety: a consumer pulls only from the peers its config allows (p2p_params.py): check_request refuses other
params at admission, and lookup re-checks them (a request that slipped past computes its prompt here, with no
connection made); malformed params never raise in the engine's step.

Invariants: a held request is freeable once its puller is done or its timeout passed (take_freeable), so the
pool becomes whole again; blocks are offered only between the end of the step that wrote them and the step
that may reuse them; staged rows are loaded or dropped exactly once per pull; the first token is handed over
at most once (only while the request has no output).
"""
from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from tokenmill.config import KVTransferConfig
from tokenmill.messages import EngineCoreRequest, FinishReason, Request, RequestStatus
from tokenmill.kv_transfer.base import ExternalHit, KVConnectorScheduler
from tokenmill.kv_transfer.p2p_params import KVTransferParams, check_pull_source, check_request_params, validated
from tokenmill.step.p2p_plan import Pull, TransferOutput, TransferPlan, pull_seconds_counters

logger = logging.getLogger("tokenmill")


@dataclass
class _PullState:
    first_block: int          # index in the request of the first pulled block
    end: int                  # tokens [first_block * block_size, end) are pulled
    ready: bool = False       # the worker reported the pull
    ok: bool = False          # ... with every block intact
    consumed: bool = False    # loaded into device blocks or dropped: supplies nothing any more
    hit_from: int = 0         # the device hit at the last lookup: where the supplied tokens start
    first_token: Optional[int] = None  # the prefill instance's first output token, taken as this request's


class TransferScheduler(KVConnectorScheduler):
    def __init__(self, cfg: KVTransferConfig, block_size: int, vocab_size: int) -> None:
        self.cfg, self.block_size, self.vocab_size = cfg, block_size, vocab_size
        self.engine_id = uuid.uuid4().hex
        self.worker_info: Optional[dict] = None   # {"host", "port", "kv_fingerprint"}, from the worker
        self.exposed: dict[str, list[int]] = {}   # producer: request id -> blocks offered
        self.held: dict[str, float] = {}          # producer: request id -> when its blocks are freed anyway
        self.pulls: dict[str, _PullState] = {}    # consumer
        self.stats: Counter[str] = Counter()
        self._pulled_by_peer: list[str] = []      # producer: held requests whose puller said done
        self._plan = TransferPlan()
        if cfg.is_consumer and not cfg.allowed_peers:
            logger.warning("KV transfer: this %s lists no prefill instances to pull from (--kv-transfer-config "
                           '"kv_connector_extra_config": {"allowed_peers": ["host:port", ...]}): requests naming '
                           "one are refused", cfg.kv_role)

    def check_request(self, req: EngineCoreRequest) -> None:
        check_request_params(req.kv_transfer_params, self.cfg)

    # -- consumer ------------------------------------------------------------------------------
    def lookup(self, req: Request, num_device_tokens: int) -> ExternalHit:
        params = req.kv_transfer_params
        if not (self.cfg.is_consumer and params and params.get("do_remote_prefill")):
            return ExternalHit(0, True)
        st = self.pulls.get(req.request_id)
        if st is None:
            source = self._pull_source(req)
            if source is None:  # refused: computed here, as after a failed pull (nothing to drop or load)
                self.pulls[req.request_id] = _PullState(0, 0, ready=True)
                self.stats["kv_pull_fallbacks"] += 1
                return ExternalHit(0, True)
            self._start_pull(req, source, num_device_tokens)
            return ExternalHit(0, False)
        if not st.ready:
            return ExternalHit(0, False)
        bs = self.block_size
        usable = st.ok and not st.consumed and st.first_block * bs <= num_device_tokens < st.end
        st.hit_from = num_device_tokens
        return ExternalHit(st.end - num_device_tokens if usable else 0, True)

    def _pull_source(self, req: Request) -> Optional[KVTransferParams]:
        """req's params, checked again (check_request refused them at admission already); None: not pulled."""
        try:
            params = validated(req.kv_transfer_params)
            check_pull_source(params, self.cfg)
        except ValueError as e:
            logger.warning("request %s: not pulling its KV, computing its prompt here: %s", req.request_id, e)
            return None
        return params

    def _start_pull(self, req: Request, params: KVTransferParams, num_device_tokens: int) -> None:
        """Pull the blocks after the device hit up to the prompt's end when req takes the prefill instance's
        first token, else up to prompt_len - 1 tokens (none: just say done)."""
        bs = self.block_size
        first_token = self._first_token(req, params)
        end = req.num_prompt_tokens if first_token is not None else min(params.num_tokens or 0,
                                                                         req.num_prompt_tokens - 1)
        end = max(end, num_device_tokens)
        first = num_device_tokens // bs
        blocks = params.remote_block_ids[first:-(-end // bs)]
        if len(blocks) < -(-end // bs) - first:  # fewer blocks than the params claim: take none, sample here
            blocks, end, first_token = [], num_device_tokens, None
        self.pulls[req.request_id] = _PullState(first, end, first_token=first_token)
        self._plan.pulls.append(self._pull(req.request_id, params, blocks))

    def _first_token(self, req: Request, params: KVTransferParams) -> Optional[int]:
        """The prefill instance's first output token if req can take it as its own with the output still equal
        to a colocated run's; None: this instance recomputes the last prompt token and samples it itself."""
        token = params.first_token_id
        if token is None:
            return None
        if token >= self.vocab_size or params.num_tokens != req.num_prompt_tokens:
            logger.warning("request %s: kv_transfer_params first_token_id %r does not fit its prompt or the "
                           "vocabulary; sampling the first token here", req.request_id, token)
            return None
        sp = req.sampling_params
        if sp.logprobs is not None:  # this instance would have no logprobs for a token it did not sample
            return None
        if sp.min_tokens:  # the prefill request runs without min_tokens: its token may be a stop token it bans
            return None
        # A seeded sample sequence: this instance's generator, starting fresh, would draw the second token with
        # the draw a colocated run used for the first.
        if sp.seed is not None and not sp.greedy:
            return None
        return token

    def first_token(self, req: Request) -> Optional[int]:
        st = self.pulls.get(req.request_id)
        if st is None or not (st.ready and st.ok) or st.consumed or req.num_output_tokens:
            return None  # a failed pull recomputes the whole prompt here and samples its first token itself
        return st.first_token

    @staticmethod
    def _pull(rid: str, params: KVTransferParams, blocks: list[int]) -> Pull:
        return Pull(rid, params.remote_host, params.remote_port, params.remote_request_id, blocks,
                    params.kv_fingerprint)

    def is_ready(self, req: Request) -> bool:
        st = self.pulls.get(req.request_id)
        return st is None or st.ready

    def on_allocated(self, req: Request, block_ids: list[int]) -> None:
        st = self.pulls.get(req.request_id)
        if st is None or not st.ready or st.consumed:
            return
        st.consumed = True
        if block_ids:  # the hit started at the device hit (a whole block), i.e. at this staged row
            self._plan.loads.append((req.request_id, st.hit_from // self.block_size - st.first_block, block_ids))
            self.stats["kv_transferred_tokens"] += st.end - st.hit_from
        elif st.ok:
            self._plan.drops.append(req.request_id)

    def release(self, req: Request) -> None:
        rid = req.request_id
        if rid in self.exposed and rid not in self.held:
            self._plan.unexpose.append(rid)  # aborted (or not held): offered no more
            del self.exposed[rid]
        st = self.pulls.get(rid)
        if st is None:
            params = req.kv_transfer_params
            if (req.status == RequestStatus.FINISHED and self.cfg.is_consumer and params
                    and params.get("do_remote_prefill")):
                source = self._pull_source(req)
                if source is not None:  # never looked up: just say done
                    self._plan.pulls.append(self._pull(rid, source, []))
            return
        if not st.consumed and (st.ok or not st.ready):
            self._plan.drops.append(rid)  # staged rows, or a pull still running
        st.consumed = True
        if req.status == RequestStatus.FINISHED:
            del self.pulls[rid]

    # -- producer ------------------------------------------------------------------------------
    def on_prompt_scheduled(self, req: Request, block_ids: list[int]) -> None:
        if self.cfg.is_producer and req.kv_transfer_params and req.kv_transfer_params.get("do_remote_decode"):
            ids = block_ids[:-(-req.num_prompt_tokens // self.block_size)]
            self.exposed[req.request_id] = ids
            self._plan.expose.append((req.request_id, ids))

    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        rid = req.request_id
        if rid not in self.exposed:
            return False, None
        ids = block_ids[:-(-req.num_prompt_tokens // self.block_size)]
        if req.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH) or self.worker_info is None:
            return False, None  # release() withdraws the offer
        if ids != self.exposed[rid]:  # re-run after a preemption: offer the blocks it has now
            self.exposed[rid] = ids
            self._plan.expose.append((rid, ids))
        self.held[rid] = time.monotonic() + self.cfg.hold_timeout_s
        info = self.worker_info
        params = {"do_remote_prefill": True, "remote_engine_id": self.engine_id, "remote_host": info["host"],
                  "remote_port": info["port"], "remote_request_id": rid, "remote_block_ids": ids,
                  "num_tokens": req.num_prompt_tokens, "kv_fingerprint": info["kv_fingerprint"]}
        if req.num_output_tokens:
            params["first_token_id"] = req.output_token_ids[0]
        return True, params

    def take_freeable(self) -> list[str]:
        now = time.monotonic()
        expired = [rid for rid, t in self.held.items() if t <= now and rid not in self._pulled_by_peer]
        self.stats["kv_hold_timeouts"] += len(expired)
        done, self._pulled_by_peer = self._pulled_by_peer, []
        return self._free(done + expired)

    def _free(self, rids: list[str]) -> list[str]:
        freed = [rid for rid in rids if self.held.pop(rid, None) is not None]
        for rid in freed:
            del self.exposed[rid]
            self._plan.unexpose.append(rid)
        return freed

    # -- both ------------------------------------------------------------------------------------
    def build_plan(self) -> Optional[TransferPlan]:
        plan, self._plan = self._plan, TransferPlan()
        # Held blocks or pulls in flight: the worker is called every step, to report "done" notes and pulls.
        plan.keep_stepping = bool(self.held) or any(not st.ready for st in self.pulls.values())
        return plan if plan else None

    def update(self, output: Optional[TransferOutput]) -> None:
        if output is None:
            return
        if output.info is not None:
            self.worker_info = output.info
        for rid, ok in output.pulled:
            st = self.pulls.get(rid)
            if st is not None:
                st.ready, st.ok = True, ok
                self.stats["kv_pulls" if ok else "kv_pull_fallbacks"] += 1
        self._done_sending(output.done_sending)
        self.stats["kv_bytes_received"] += output.bytes_received
        self.stats["kv_bytes_sent"] += output.bytes_sent
        for key, n in pull_seconds_counters(output.pull_seconds).items():
            self.stats[key] = self.stats.get(key, 0) + n

    def _done_sending(self, rids: list[str]) -> None:
        sent = [rid for rid in rids if rid in self.held]
        self.stats["kv_sent_requests"] += len(sent)
        self._pulled_by_peer.extend(sent)

    def counters(self) -> dict[str, int]:
        return {**self.stats, "kv_held_requests": len(self.held)}
