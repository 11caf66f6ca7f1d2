"""Disaggregated prefill/decode (kv_transfer/p2p_*): a prefill engine and a decode engine talking over real TCP
sockets on 127.0.0.1. Greedy outputs equal a colocated engine's; the decode engine pulls every prompt token's KV,
takes the prefill engine's first token as its own and computes no prompt token; where it cannot take that token
exactly (logprobs, min_tokens, a seeded sample, n > 1, a failed pull) it samples the first token itself and the
output still equals the colocated one; corrupt, failed, aborted and never-pulled transfers leave both KV pools
whole and every answer right."""
import random
import socket
import time

import pytest
import torch

from tests.models import tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig, KVTransferConfig
from tokenmill.models.resolution import resolve_engine_config
from tokenmill.messages import EngineCoreRequest, Request
from tokenmill.kv_transfer.p2p_transport import TcpTransport
from tokenmill.fleet.launchers import free_port

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PREFILL_ONLY = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
LENGTHS = (1, 2, 5, 16, 17, 32, 40, 70)  # exact multiples of the block size (16) and 1-2 token prompts


def _prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def _peer(llm) -> str:
    """A producer engine's KV address, as a consumer's allowed_peers lists it."""
    return f"127.0.0.1:{llm.engine.config.kv_transfer.kv_port}"


UNREACHABLE = "127.0.0.1:1"  # allowed, but nobody listens there
PROCESS_KV_PORT = free_port()  # test_prefill_instance_in_another_process's producer


def _llm(role=None, peers=(), **kw):
    """An engine; a producer serves its KV on a port of its own, a consumer pulls from `peers` (engines or
    "host:port") only."""
    xfer = None if role is None else {"kv_connector": "TokenmillConnector", "kv_role": role, **kw.pop("xfer", {})}
    if role == "kv_producer":
        xfer.setdefault("kv_port", free_port())
    if peers:
        xfer["kv_connector_extra_config"] = {"allowed_peers": [p if isinstance(p, str) else _peer(p) for p in peers]}
    return LLM(tiny_model("llama"), dtype="float32", device="cpu", num_gpu_blocks_override=48,
               kv_transfer_config=xfer, **kw)


@pytest.fixture(scope="module")
def engines():
    prefill = _llm("kv_producer")
    decode = _llm("kv_consumer", peers=[prefill, UNREACHABLE, f"127.0.0.1:{PROCESS_KV_PORT}"])
    ref = _llm(None, enable_prefix_caching=False)
    yield prefill, decode, ref
    for llm in (prefill, decode, ref):
        llm.engine.shutdown()


_ids = iter(range(10**6))


def _run(llm, ids, sp, params=None, abort_after_steps=None, timeout=30.0, blocks=None, logprobs=None, eos=None,
         outs=None):
    """(tokens, finishing output) of one request run alone on llm's engine; `blocks` (a list) gets its block
    ids while it runs, `logprobs` (a list) each new token's, `outs` (a list) its outputs as (step number, output)."""
    rid = f"r{next(_ids)}"
    llm.engine.add_request(EngineCoreRequest(rid, ids, sp, [] if eos is None else [eos], kv_transfer_params=params))
    tokens, deadline, steps = [], time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        steps += 1
        if steps == abort_after_steps:
            llm.engine.abort_requests([rid])
        for out in llm.engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                if outs is not None:
                    outs.append((steps, out))
                if logprobs is not None:
                    logprobs += out.new_logprobs or []
                if out.finished:
                    return tokens, out
        if blocks is not None and llm.engine.scheduler.kv.block_ids(rid):
            blocks[:] = llm.engine.scheduler.kv.block_ids(rid)
    raise AssertionError(f"request {rid} did not finish in {timeout}s")


def _settle(*llms, timeout=10.0):
    """Step each engine until it holds nothing (a prefill engine frees blocks once the puller is done)."""
    deadline = time.monotonic() + timeout
    for llm in llms:
        while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
            llm.engine.step()
        assert llm.engine.scheduler.kv.is_whole(), "KV blocks leaked"


def _counters(llm):
    return dict(llm.engine.stats().kv_connector)


def _disagg(prefill, decode, ids, sp=GREEDY, prefill_sp=PREFILL_ONLY, **kw):
    _, fin = _run(prefill, ids, prefill_sp, {"do_remote_decode": True})
    params = fin.kv_transfer_params
    assert params["do_remote_prefill"] and params["num_tokens"] == len(ids)
    assert params["first_token_id"] == fin.new_token_ids[0]
    return _run(decode, ids, sp, params, **kw)


def _computed(llm):
    """Prompt tokens the engine's model has run so far (EngineStats.prompt_tokens_computed)."""
    return llm.engine.stats().prompt_tokens_computed


PENALIZED = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3,
                           frequency_penalty=0.5, presence_penalty=0.4)


def test_outputs_equal_colocated_and_decode_computes_no_prompt_token(engines):
    """The decode engine pulls all n prompt tokens' KV (the last block partial) and emits the prefill engine's
    first token as its own first output as soon as the pull is in, a step before the second token; penalties
    see that token as an output."""
    prefill, decode, ref = engines
    for i, n in enumerate(LENGTHS):
        ids = _prompt(n, seed=i)
        # (the second run of a prompt finds its first blocks in the decode engine's cache; at 32, after the first
        # token is taken, all of them: the pulled rows are dropped)
        for sp in (GREEDY, PENALIZED) if n in (5, 32, 40) else (GREEDY,):
            expected, _ = _run(ref, ids, sp)
            kv, before, computed = decode.engine.scheduler.kv, _counters(decode), _computed(decode)
            hits, ext, outs = kv.num_hits, kv.num_external_hits, []
            tokens, fin = _disagg(prefill, decode, ids, sp, outs=outs)
            assert tokens == expected, (n, sp)
            assert _computed(decode) == computed  # not one prompt token computed on the decode side
            assert (kv.num_hits - hits) + (kv.num_external_hits - ext) == n and fin.num_cached_tokens == n
            (step, first), (next_step, _) = outs[:2]
            assert first.new_token_ids == expected[:1] and first.num_cached_tokens == n and step < next_step
            after = _counters(decode)
            assert after.get("kv_pulls", 0) == before.get("kv_pulls", 0) + 1 and not after.get("kv_pull_fallbacks")
            assert after["kv_transferred_tokens"] - before.get("kv_transferred_tokens", 0) == n - (kv.num_hits - hits)
            _settle(prefill, decode)
    assert not _counters(prefill).get("kv_hold_timeouts")


def test_first_token_that_ends_the_request_finishes_it_without_a_step(engines):
    """max_tokens 1, the first token as EOS, or as a stop token: the decode engine finishes the request as soon as
    its pull is in, allocating nothing and running no step for it; the answer equals the colocated one."""
    prefill, decode, ref = engines
    ids = _prompt(21, seed=30)
    first = _run(ref, ids, GREEDY)[0][0]
    cases = [(SamplingParams(temperature=0, max_tokens=1), None, "LENGTH"),
             (SamplingParams(temperature=0, max_tokens=6), first, "STOP"),  # the first token is EOS
             (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[first]), None, "STOP")]
    for sp, eos, reason in cases:
        expected, want = _run(ref, ids, sp, eos=eos)
        _, fin = _run(prefill, ids, PREFILL_ONLY, {"do_remote_decode": True})
        computed, blocks = _computed(decode), []
        tokens, got = _run(decode, ids, sp, fin.kv_transfer_params, eos=eos, blocks=blocks)
        assert tokens == expected == [first] and got.finish_reason == want.finish_reason, reason
        assert got.stop_reason == want.stop_reason and got.num_cached_tokens == len(ids)
        assert not blocks and _computed(decode) == computed  # never allocated, never ran
        _settle(prefill, decode)
    assert _counters(decode).get("kv_pull_fallbacks", 0) == 0


def test_requests_that_cannot_take_the_first_token_sample_it_themselves(engines):
    """logprobs (the decode side has none for a token it did not sample), min_tokens (the prefill request runs
    without it, as the router sends it: its token here is EOS, which min_tokens bans), a seeded sample (the
    decode side's generator would start a draw behind) and n > 1 (one token cannot seed several samples): the
    decode engine pulls n - 1 tokens, recomputes the last one and samples; outputs equal the colocated ones."""
    prefill, decode, ref = engines
    ids = _prompt(37, seed=31)
    eos = _run(ref, ids, GREEDY)[0][0]
    cases = [(SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2), None, None),
             (SamplingParams(temperature=0, max_tokens=6, min_tokens=3), eos, None),
             (SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True),
              None, SamplingParams(temperature=0.8, seed=7, max_tokens=1, ignore_eos=True))]
    for sp, eos_id, prefill_sp in cases:
        want_lps, got_lps = [], []
        expected, _ = _run(ref, ids, sp, eos=eos_id, logprobs=want_lps)
        _, fin = _run(prefill, ids, prefill_sp or PREFILL_ONLY, {"do_remote_decode": True}, eos=eos_id)
        computed, before, hits = _computed(decode), _counters(decode), decode.engine.scheduler.kv.num_hits
        tokens, _ = _run(decode, ids, sp, fin.kv_transfer_params, eos=eos_id, logprobs=got_lps)
        assert tokens == expected, sp
        assert _computed(decode) - computed == 1  # the last prompt token
        hits = decode.engine.scheduler.kv.num_hits - hits  # (the second case on finds the first's blocks cached)
        transferred = _counters(decode)["kv_transferred_tokens"] - before.get("kv_transferred_tokens", 0)
        assert transferred + hits == len(ids) - 1
        for (a_ids, a_lp, a_rank), (b_ids, b_lp, b_rank) in zip(got_lps, want_lps):
            assert a_ids == b_ids and a_rank == b_rank and a_lp == pytest.approx(b_lp, abs=1e-4)
        assert len(got_lps) == len(want_lps)
        _settle(prefill, decode)
    # n = 2 (offline generate fans it out): each sample samples its own first token
    _, fin = _run(prefill, ids, PREFILL_ONLY, {"do_remote_decode": True})
    sp = SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True)
    computed = _computed(decode)
    got = decode.generate([{"prompt_token_ids": ids, "kv_transfer_params": fin.kv_transfer_params}], sp,
                          use_tqdm=False)[0]
    want = ref.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    assert _computed(decode) - computed >= 2  # at least each sample's last prompt token
    _settle(prefill, decode)


def test_n_samples_do_not_share_the_prefill_instances_first_token():
    from tokenmill.engine.frontend import fan_out

    params = {"do_remote_prefill": True, "remote_block_ids": [3], "num_tokens": 2, "first_token_id": 9}
    one = fan_out("r", [1, 2], SamplingParams(n=1), None, True, kv_transfer_params=params)
    two = fan_out("r", [1, 2], SamplingParams(n=2), None, True, kv_transfer_params=params)
    assert one[0].kv_transfer_params == params
    assert [r.kv_transfer_params for r in two] == [{k: v for k, v in params.items() if k != "first_token_id"}] * 2


def test_structured_output_takes_the_first_token_and_advances_its_grammar(engines):
    """A constrained request takes the prefill engine's first token (sampled under the same grammar) and feeds it
    to its own grammar matcher: the rest of the output follows the grammar and equals the colocated one."""
    pytest.importorskip("xgrammar")
    from tokenmill.sampling_params import StructuredOutputsParams

    prefill, decode, ref = engines
    so = StructuredOutputsParams(regex=r"(ab|cd)[a-z]{2,6} [0-9]{3}")
    sp = SamplingParams(temperature=0, max_tokens=16, structured_outputs=so)
    one = SamplingParams(temperature=0, max_tokens=1, structured_outputs=so)
    for i, n in enumerate((9, 32)):
        ids = _prompt(n, seed=40 + i)
        expected, _ = _run(ref, ids, sp)
        computed = _computed(decode)
        tokens, fin = _disagg(prefill, decode, ids, sp, prefill_sp=one)
        assert tokens == expected and _computed(decode) == computed, n
        _settle(prefill, decode)


def test_decode_side_prefix_hit_pulls_only_missing_blocks(engines):
    prefill, decode, ref = engines
    a = _prompt(50, seed=100)
    b = a[:48] + _prompt(20, seed=101)  # shares 3 full blocks with a
    _disagg(prefill, decode, a)
    _settle(prefill, decode)
    kv, before = decode.engine.scheduler.kv, _counters(decode)
    hits = kv.num_hits
    tokens, _ = _disagg(prefill, decode, b)
    assert tokens == _run(ref, b, GREEDY)[0]
    assert kv.num_hits - hits == 48
    after = _counters(decode)
    assert after["kv_transferred_tokens"] - before["kv_transferred_tokens"] == len(b) - 48
    block_bytes = decode.engine.executor.bytes_per_block()
    assert after["kv_bytes_received"] - before["kv_bytes_received"] == 2 * block_bytes  # blocks 3 and 4 only
    _settle(prefill, decode)


def test_corrupt_block_is_detected_and_recomputed(engines):
    """The params carry first_token_id, but a failed pull recomputes the whole prompt and samples here."""
    prefill, decode, ref = engines
    ids = _prompt(45, seed=1007)
    before, computed = _counters(decode).get("kv_pull_fallbacks", 0), _computed(decode)
    TcpTransport.corrupt_next_blocks = 1
    try:
        tokens, _ = _disagg(prefill, decode, ids)
    finally:
        TcpTransport.corrupt_next_blocks = 0
    assert tokens == _run(ref, ids, GREEDY)[0]
    assert _counters(decode)["kv_pull_fallbacks"] == before + 1 and _computed(decode) - computed == len(ids)
    _settle(prefill, decode)  # the puller said done despite the corruption: the prefill side frees at once
    assert not _counters(prefill).get("kv_hold_timeouts")


def test_unreachable_or_refused_pull_falls_back(engines):
    prefill, decode, ref = engines
    ids = _prompt(30, seed=8)
    _, fin = _run(prefill, ids, PREFILL_ONLY, {"do_remote_decode": True})
    bad = dict(fin.kv_transfer_params, kv_fingerprint="00" * 16)  # another model's KV: refused
    before = _counters(decode).get("kv_pull_fallbacks", 0)
    assert _run(decode, ids, GREEDY, bad)[0] == _run(ref, ids, GREEDY)[0]
    gone = dict(fin.kv_transfer_params, remote_port=1)  # nobody listens there
    assert _run(decode, ids, GREEDY, gone)[0] == _run(ref, ids, GREEDY)[0]
    assert _counters(decode)["kv_pull_fallbacks"] == before + 2
    _settle(prefill, decode)


def _run_unchecked(llm, ids, sp, params, timeout=30.0):
    """_run's tokens for a request put straight into the scheduler, past EngineCore.add_request's checks."""
    rid = f"r{next(_ids)}"
    llm.engine.scheduler.add_request(Request(EngineCoreRequest(rid, ids, sp, kv_transfer_params=params),
                                             llm.engine.config.model.max_model_len))
    tokens, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        for out in llm.engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                if out.finished:
                    return tokens
    raise AssertionError(f"request {rid} did not finish in {timeout}s")


def test_pull_sources_not_allowed_are_refused_and_never_contacted(engines):
    """Issue 29, defect 10: a consumer pulls only from its allowed_peers. Params naming another address (a
    listening socket here), or malformed ones ("remote_port": "abc" once killed the engine), are rejected at
    admission with a ValueError (the API's 400), and params that reach the scheduler anyway are not pulled: the
    prompt is computed here. The socket never sees a connection, and the engine serves on."""
    prefill, decode, ref = engines
    ids = _prompt(20, seed=500)
    _, fin = _run(prefill, ids, PREFILL_ONLY, {"do_remote_decode": True})
    good = fin.kv_transfer_params
    with socket.create_server(("127.0.0.1", 0)) as trap:
        port = trap.getsockname()[1]
        refused = [dict(good, remote_port=port), dict(good, remote_host="localhost"), dict(good, remote_port="abc"),
                   dict(good, remote_port=70000), dict(good, remote_block_ids=["x"]), dict(good, surprise=1),
                   {k: v for k, v in good.items() if k != "remote_host"}]
        for bad in refused:
            with pytest.raises(ValueError, match="kv_transfer_params"):
                decode.engine.add_request(EngineCoreRequest(f"bad{next(_ids)}", ids, GREEDY,
                                                            kv_transfer_params=bad))
        want = _run(ref, ids, GREEDY)[0]
        fallbacks = _counters(decode).get("kv_pull_fallbacks", 0)
        for bad in (dict(good, remote_port=port), dict(good, remote_port="abc")):
            assert _run_unchecked(decode, ids, GREEDY, bad) == want
        assert _counters(decode)["kv_pull_fallbacks"] == fallbacks + 2
        trap.settimeout(0.2)
        with pytest.raises(socket.timeout):
            trap.accept()  # nothing connected
    assert _run(decode, ids, GREEDY, good)[0] == want  # the allowed producer: pulled (and its blocks freed)
    _settle(prefill, decode)


def test_abort_mid_transfer_leaves_both_pools_whole(engines):
    prefill, decode, _ = engines
    for abort_after in (1, 2, 3):  # before its lookup (it just says done), while pulling, after
        ids = _prompt(60, seed=9 + abort_after)
        _, fin = _run(prefill, ids, PREFILL_ONLY, {"do_remote_decode": True})
        _, out = _run(decode, ids, GREEDY, fin.kv_transfer_params, abort_after_steps=abort_after)
        assert out.finish_reason == 2  # ABORT
        _settle(prefill, decode)
    assert not _counters(prefill).get("kv_hold_timeouts")
    # A pull of blocks that are never offered is cancelled by the abort (its thread ends, nothing is staged).
    params = dict(fin.kv_transfer_params, remote_request_id="never-offered")
    _, fin = _run(decode, ids, GREEDY, params, abort_after_steps=3)
    assert fin.finish_reason == 2
    _settle(decode)
    worker = decode.engine.executor.collective_rpc(lambda w: w.kv_connector.transfer)[0]
    deadline = time.monotonic() + 5
    while worker.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker.in_flight and not worker.staged and not worker.cancelled


def test_never_pulled_blocks_are_freed_after_the_timeout():
    prefill = _llm("kv_producer", xfer={"hold_timeout_s": 0.3})
    try:
        _, fin = _run(prefill, _prompt(40, seed=11), PREFILL_ONLY, {"do_remote_decode": True})
        assert fin.kv_transfer_params["remote_block_ids"] and prefill.engine.scheduler.held
        assert not prefill.engine.scheduler.kv.is_whole()  # held for the decode side
        _settle(prefill)
        assert _counters(prefill)["kv_hold_timeouts"] == 1
    finally:
        prefill.engine.shutdown()


def test_fp8_kv_cache_transfers_its_narrow_bytes():
    prefill = _llm("kv_producer", kv_cache_dtype="fp8")
    decode, ref = _llm("kv_consumer", peers=[prefill], kv_cache_dtype="fp8"), _llm(None, kv_cache_dtype="fp8")
    try:
        assert decode.engine.executor.bytes_per_block() * 4 == _llm_block_bytes_f32()
        for i, n in enumerate((17, 40)):
            ids = _prompt(n, seed=50 + i)
            tokens, _ = _disagg(prefill, decode, ids)
            assert tokens == _run(ref, ids, GREEDY)[0]
        c = _counters(decode)
        assert c["kv_pulls"] == 2 and c["kv_bytes_received"] == 5 * decode.engine.executor.bytes_per_block()
        _settle(prefill, decode)
    finally:
        for llm in (prefill, decode, ref):
            llm.engine.shutdown()


def _llm_block_bytes_f32():
    return 2 * 2 * 2 * 16 * 16 * 4  # layers x K,V x KV heads x block tokens x head dim x float32


# int8 KV: each instance calibrates its scales on its first prefill, so a pull carries the producer's.
INT8_FIRST_PROMPT = _prompt(40, seed=300)  # the int8 producer's first prefill: its scales come from it


@pytest.fixture(scope="module")
def int8_producer():
    prefill = _llm("kv_producer", kv_cache_dtype="int8")
    _run(prefill, INT8_FIRST_PROMPT, PREFILL_ONLY)
    yield prefill
    prefill.engine.shutdown()


def _kv_scales(llm):
    """Each layer's [2, KV heads] K/V scales."""
    return llm.engine.executor.collective_rpc(lambda w: [l.self_attn.kv_quant.scale.clone() for l in w.model.layers])[0]


def _kv_tokens(llm, block_ids, n):
    """The KV cache's stored values of the first n tokens in these blocks, per layer [2, KV heads, n, dim]."""
    def read(w):
        return [kv[:, :, block_ids].flatten(2, 3)[:, :, :n].clone() for kv in w.runner.kv_caches]
    return llm.engine.executor.collective_rpc(read)[0]


def _pulled(prefill, decode, ids, **kw):
    """Prefill on one engine, decode on the other: (tokens, the producer's and the consumer's stored int8 KV of
    the n transferred tokens)."""
    n, blocks = len(ids), []
    _, fin = _run(prefill, ids, PREFILL_ONLY, {"do_remote_decode": True})
    sent = _kv_tokens(prefill, fin.kv_transfer_params["remote_block_ids"], n)  # held: not reused yet
    tokens, _ = _run(decode, ids, GREEDY, fin.kv_transfer_params, blocks=blocks, **kw)
    return tokens, sent, _kv_tokens(decode, blocks, n)


def test_int8_kv_transfer_uncalibrated_consumer_adopts_the_producers_scales(int8_producer):
    """A decode engine with no prefill of its own yet takes the producer's scales with the first pull and uses
    the int8 bytes as they arrived (1 byte per value on the wire). Greedy tokens equal a colocated int8 engine
    that calibrated on the same first prompt. (Not its logits bit for bit: a colocated prefill attends to its own
    chunk's unquantized K/V, the decode engine to the stored int8 KV of the n pulled tokens, as any colocated
    prefix-cache hit does.) Scales that arrive corrupt are caught by their CRC: recomputed."""
    prefill = int8_producer
    decode, ref = _llm("kv_consumer", peers=[prefill], kv_cache_dtype="int8"), _llm(None, kv_cache_dtype="int8",
                                                                                    enable_prefix_caching=False)
    try:
        _run(ref, INT8_FIRST_PROMPT, GREEDY)  # calibrates ref as the producer was
        assert decode.engine.executor.bytes_per_block() * 4 == _llm_block_bytes_f32()
        kv, sent_before = decode.engine.scheduler.kv, _counters(prefill).get("kv_bytes_sent", 0)
        for i, n in enumerate((40, 17, 70)):
            ids = INT8_FIRST_PROMPT if i == 0 else _prompt(n, seed=310 + i)
            hits, ext = kv.num_hits, kv.num_external_hits
            tokens, sent, stored = _pulled(prefill, decode, ids)
            assert tokens == _run(ref, ids, GREEDY)[0], n
            assert (kv.num_hits - hits) + (kv.num_external_hits - ext) == n  # no prompt token computed here
            assert all(a.dtype == b.dtype == torch.int8 and torch.equal(a, b) for a, b in zip(sent, stored))
            _settle(prefill, decode)
        assert all(torch.equal(a, b) for a, b in zip(_kv_scales(decode), _kv_scales(prefill)))
        c = _counters(decode)
        blocks = sum(-(-n // 16) for n in (40, 17, 70))
        assert c["kv_pulls"] == 3 and not c.get("kv_pull_fallbacks")
        assert c["kv_bytes_received"] == blocks * decode.engine.executor.bytes_per_block()
        assert _counters(prefill)["kv_bytes_sent"] - sent_before == c["kv_bytes_received"]

        ids = _prompt(33, seed=320)
        TcpTransport.corrupt_next_scales = 1
        try:
            tokens, _ = _disagg(prefill, decode, ids)
        finally:
            TcpTransport.corrupt_next_scales = 0
        assert tokens == _run(ref, ids, GREEDY)[0] and _counters(decode)["kv_pull_fallbacks"] == 1
        _settle(prefill, decode)
    finally:
        decode.engine.shutdown()
        ref.engine.shutdown()


def _logprob_gap(got, want):
    """The largest |logprob difference| over the top tokens both list, at each position up to the first where
    the sampled tokens differ (after that the two runs continue different texts)."""
    gap = 0.0
    for (ids_a, lp_a, _), (ids_b, lp_b, _) in zip(got, want):
        b = dict(zip(ids_b, lp_b))
        gap = max([gap] + [abs(v - b[t]) for t, v in zip(ids_a, lp_a) if t in b])
        if ids_a[0] != ids_b[0]:
            break
    return gap


def test_int8_kv_transfer_into_a_consumer_calibrated_differently_requantizes(int8_producer):
    """A decode engine whose first transfer fails (a corrupt block) recomputes that prompt and calibrates on it;
    later pulls from the producer (calibrated on another prompt) are requantized into the decode engine's own
    scales: stored = round(received x producer scale / own scale), exactly, per K/V and head; its scales stay.

    Against a colocated int8 engine calibrated on the same prompt the result is not exact: requantizing rounds
    twice, so a stored value may differ by one int8 step (at most half a producer step more error per value,
    the same order as int8 quantization's own). Held to: >= 90% greedy token agreement (as int8 vs float32 in
    test_kv_cache_dtype) and top-3 logprobs within 0.1 nats up to the first differing token (measured: <= 0.05;
    an int8 cache's own logprob error against float32 on these prompts is of the same size)."""
    prefill = int8_producer
    decode, ref = _llm("kv_consumer", peers=[prefill], kv_cache_dtype="int8"), _llm(None, kv_cache_dtype="int8",
                                                                                    enable_prefix_caching=False)
    try:
        own = _prompt(30, seed=400)
        TcpTransport.corrupt_next_blocks = 1
        try:
            tokens, _ = _disagg(prefill, decode, own)
        finally:
            TcpTransport.corrupt_next_blocks = 0
        assert tokens == _run(ref, own, GREEDY)[0] and _counters(decode)["kv_pull_fallbacks"] == 1
        scales, theirs = _kv_scales(decode), _kv_scales(prefill)
        assert all(torch.equal(a, b) for a, b in zip(scales, _kv_scales(ref)))  # both calibrated on `own`
        assert not any(torch.equal(a, b) for a, b in zip(scales, theirs))
        _settle(prefill, decode)

        agree = total = 0
        lp_sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
        for i, n in enumerate((40, 17, 70, 55)):
            ids = _prompt(n, seed=410 + i)
            got, want = [], []
            _, fin = _run(prefill, ids, PREFILL_ONLY, {"do_remote_decode": True})
            sent = _kv_tokens(prefill, fin.kv_transfer_params["remote_block_ids"], n - 1)
            blocks = []
            tokens, _ = _run(decode, ids, lp_sp, fin.kv_transfer_params, blocks=blocks, logprobs=got)
            expected, _ = _run(ref, ids, lp_sp, logprobs=want)
            for x, s_them, s_own, stored in zip(sent, theirs, scales, _kv_tokens(decode, blocks, n - 1)):
                s_them, s_own = s_them[:, :, None, None], s_own[:, :, None, None]
                assert torch.equal(stored, (x.float() * s_them / s_own).round().clamp(-127, 127).to(torch.int8))
            agree += sum(a == b for a, b in zip(tokens, expected))
            total += len(expected)
            assert _logprob_gap(got, want) < 0.1, n
            _settle(prefill, decode)
        assert agree >= 0.9 * total, (agree, total)
        assert all(torch.equal(a, b) for a, b in zip(_kv_scales(decode), scales))  # kept its own
        c = _counters(decode)
        assert c["kv_pulls"] == 4 and c["kv_pull_fallbacks"] == 1  # (kv_pulls counts intact pulls)
    finally:
        decode.engine.shutdown()
        ref.engine.shutdown()


def test_kv_transfer_config_errors_and_world_size_refusal():
    assert KVTransferConfig.parse('{"kv_connector": "TokenmillConnector", "kv_role": "kv_producer"}').is_producer
    for bad, msg in (("{nope", "not valid JSON"), ('["kv_both"]', "must be a JSON object"),
                     ('{"kv_role": "prefill"}', "kv_role must be one of"), ('{"kv_connector": "Nixl"}', "kv_connector"),
                     ('{"kv_port": -1}', "kv_port"), ('{"kv_rol": "kv_both"}', "unknown"),
                     ('{"kv_connector_extra_config": {"allowed_peers": ["10.0.0.1"]}}', "host:port"),
                     ('{"kv_connector_extra_config": {"allowed_peers": "10.0.0.1:1"}}', "must be a list"),
                     ('{"kv_connector_extra_config": {"allowed_peer": []}}', "allowed_peers")):
        with pytest.raises(ValueError, match=msg):
            KVTransferConfig.parse(bad)
    peers = {"allowed_peers": ["10.0.0.1:14579", "[::1]:5"]}
    assert KVTransferConfig.parse({"kv_connector_extra_config": peers}).allowed_peers == {("10.0.0.1", 14579),
                                                                                         ("::1", 5)}
    cfg = EngineConfig.from_kwargs(model=tiny_model("llama"), tensor_parallel_size=2,
                                   kv_transfer_config={"kv_role": "kv_both"})
    with pytest.raises(ValueError, match="tensor or pipeline parallel"):
        cfg._check_parallel_features()


_PRODUCER = r"""
import json, queue, sys, threading
from tokenmill import LLM, SamplingParams
from tokenmill.messages import EngineCoreRequest, Request
llm = LLM(sys.argv[1], dtype="float32", device="cpu", num_gpu_blocks_override=48,
          kv_transfer_config={"kv_connector": "TokenmillConnector", "kv_role": "kv_producer",
                              "kv_port": int(sys.argv[2])})
lines = queue.Queue()
threading.Thread(target=lambda: [lines.put(l) for l in sys.stdin], daemon=True).start()
print(json.dumps({"ready": True}), flush=True)
eng, n = llm.engine, 0
while True:
    try:
        msg = json.loads(lines.get(timeout=0.01))
    except queue.Empty:
        if eng.has_unfinished_requests():
            eng.step()  # hands back blocks the decode side is done with
        continue
    if msg.get("quit"):
        print(json.dumps({"whole": eng.scheduler.kv.is_whole(), "held": len(eng.scheduler.held)}), flush=True)
        break
    n += 1
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    eng.add_request(EngineCoreRequest(f"p{n}", msg["ids"], sp, kv_transfer_params={"do_remote_decode": True}))
    fin = None
    while fin is None:
        fin = next((o for o in eng.step() if o.finished), None)
    print(json.dumps(fin.kv_transfer_params), flush=True)
"""


@pytest.mark.distributed
def test_prefill_instance_in_another_process(engines):
    """The prefill engine in its own process: the decode engine pulls over TCP, outputs equal colocated, and
    the prefill process's pool is whole once the decode side is done."""
    import json
    import subprocess
    import sys

    _, decode, ref = engines
    proc = subprocess.Popen([sys.executable, "-c", _PRODUCER, tiny_model("llama"), str(PROCESS_KV_PORT)],
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(proc.stdout.readline())["ready"]
        before = _counters(decode)
        for i, n in enumerate((9, 33, 64)):
            ids = _prompt(n, seed=200 + i)
            proc.stdin.write(json.dumps({"ids": ids}) + "\n")
            proc.stdin.flush()
            params = json.loads(proc.stdout.readline())
            kv = decode.engine.scheduler.kv
            hits, ext = kv.num_hits, kv.num_external_hits
            assert _run(decode, ids, GREEDY, params)[0] == _run(ref, ids, GREEDY)[0]
            assert (kv.num_hits - hits) + (kv.num_external_hits - ext) == n
        _settle(decode)
        assert _counters(decode)["kv_pulls"] == before.get("kv_pulls", 0) + 3
        time.sleep(0.3)  # the producer steps on its own and hands the blocks back
        proc.stdin.write(json.dumps({"quit": True}) + "\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == {"whole": True, "held": 0}
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_portable_fingerprint_survives_a_copied_checkpoint(tiny, tmp_path):
    """A prefill and a decode instance on two machines load copies of the model: same portable fingerprint;
    a changed weight file differs."""
    import shutil

    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.kv_transfer.fingerprint import kv_fingerprint

    kv = [torch.zeros(2, 2, 4, 16, 8)]
    copy = tmp_path / "copy"
    shutil.copytree(tiny("llama"), copy)
    a = resolve_engine_config(EngineConfig.from_kwargs(model=tiny("llama"), dtype="float32"))
    b = resolve_engine_config(EngineConfig.from_kwargs(model=str(copy), dtype="float32"))
    assert kv_fingerprint(a, kv, portable=True) == kv_fingerprint(b, kv, portable=True)
    assert kv_fingerprint(a, kv) != kv_fingerprint(b, kv)  # the disk tier's stays path-bound
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    assert len(data) < 2**20  # a tiny model: the hashed first MiB is the whole file
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    assert kv_fingerprint(a, kv, portable=True) != kv_fingerprint(b, kv, portable=True)


def test_wildcard_bind_advertises_a_reachable_address():
    import ipaddress

    from tokenmill.kv_transfer.p2p_params import advertised_host

    assert advertised_host("127.0.0.1") == "127.0.0.1"
    addr = ipaddress.ip_address(advertised_host("0.0.0.0"))
    assert not addr.is_unspecified


def test_transfer_counters_and_time_histogram_reach_metrics():
    """The decode side's pull counters and transfer time histogram in /metrics' Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    from tokenmill.messages import EngineStats
    from tokenmill.step.p2p_plan import pull_seconds_counters
    from tokenmill.serve.metrics import ServerMetrics

    kv = {"kv_pulls": 3, "kv_pull_fallbacks": 1, "kv_bytes_received": 4096, "kv_held_requests": 0,
          **pull_seconds_counters([0.004, 0.02, 0.3])}
    metrics = ServerMetrics("m")
    metrics.on_engine_stats(EngineStats(0, 0, 0.0, 0, 0, 0, 1, 1, kv_connector=kv))
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert fams["tokenmill:kv_pulls"].samples[0].value == 3
    assert fams["tokenmill:kv_bytes_received"].samples[0].value == 4096
    hist = {s.labels.get("le"): s.value for s in fams["tokenmill:kv_transfer_seconds"].samples
            if s.name.endswith("_bucket")}
    assert (hist["0.005"], hist["0.025"], hist["0.5"], hist["+Inf"]) == (1, 2, 3, 3)


def test_offline_generate_carries_kv_transfer_params(engines):
    """LLM.generate takes kv_transfer_params in a prompt dict (like cache_salt) and returns the prefill side's
    in RequestOutput.kv_transfer_params; the decode side's output equals the colocated one."""
    prefill, decode, ref = engines
    ids = _prompt(37, seed=99)
    pulls = decode.engine.stats().kv_connector.get("kv_pulls", 0)
    first = prefill.generate([{"prompt_token_ids": ids, "kv_transfer_params": {"do_remote_decode": True}}],
                             PREFILL_ONLY, use_tqdm=False)[0]
    params = first.kv_transfer_params
    assert params["do_remote_prefill"] and params["num_tokens"] == len(ids)
    got = decode.generate([{"prompt_token_ids": ids, "kv_transfer_params": params}], GREEDY, use_tqdm=False)[0]
    want = ref.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert decode.engine.stats().kv_connector.get("kv_pulls", 0) == pulls + 1
    _settle(prefill, decode)
