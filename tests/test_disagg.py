"""Disaggregated prefill/decode (kv_transfer/p2p_*): a prefill engine and a decode engine talking over real TCP
sockets on 127.0.0.1. Greedy outputs equal a colocated engine's; the decode engine computes only the last
prompt token of a transferred prompt; corrupt, failed, aborted and never-pulled transfers leave both KV pools
whole and every answer right."""
import random
import time

import pytest
import torch

from tests.models import tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig, KVTransferConfig
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.kv_transfer.p2p_transport import TcpTransport

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PREFILL_ONLY = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
LENGTHS = (5, 16, 17, 40, 70)


def _prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def _llm(role=None, **kw):
    xfer = None if role is None else {"kv_connector": "TokenmillConnector", "kv_role": role, **kw.pop("xfer", {})}
    return LLM(tiny_model("llama"), dtype="float32", device="cpu", num_gpu_blocks_override=48,
               kv_transfer_config=xfer, **kw)


@pytest.fixture(scope="module")
def engines():
    prefill, decode, ref = _llm("kv_producer"), _llm("kv_consumer"), _llm(None, enable_prefix_caching=False)
    yield prefill, decode, ref
    for llm in (prefill, decode, ref):
        llm.engine.shutdown()


_ids = iter(range(10**6))


def _run(llm, ids, sp, params=None, abort_after_steps=None, timeout=30.0, blocks=None, logprobs=None):
    """(tokens, finishing output) of one request run alone on llm's engine; `blocks` (a list) gets its block
    ids while it runs, `logprobs` (a list) each new token's."""
    rid = f"r{next(_ids)}"
    llm.engine.add_request(EngineCoreRequest(rid, ids, sp, kv_transfer_params=params))
    tokens, deadline, steps = [], time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        steps += 1
        if steps == abort_after_steps:
            llm.engine.abort_requests([rid])
        for out in llm.engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
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


def _disagg(prefill, decode, ids, **kw):
    _, fin = _run(prefill, ids, PREFILL_ONLY, {"do_remote_decode": True})
    params = fin.kv_transfer_params
    assert params["do_remote_prefill"] and params["num_tokens"] == len(ids)
    return _run(decode, ids, GREEDY, params, **kw)


def test_outputs_equal_colocated_and_decode_computes_only_the_last_prompt_token(engines):
    prefill, decode, ref = engines
    for i, n in enumerate(LENGTHS):
        ids = _prompt(n, seed=i)
        expected, _ = _run(ref, ids, GREEDY)
        kv, before = decode.engine.scheduler.kv, _counters(decode)
        hits, ext = kv.num_hits, kv.num_external_hits
        tokens, _ = _disagg(prefill, decode, ids)
        assert tokens == expected, n
        assert (kv.num_hits - hits) + (kv.num_external_hits - ext) == n - 1  # computed: the last prompt token only
        after = _counters(decode)
        assert after.get("kv_pulls", 0) == before.get("kv_pulls", 0) + 1 and not after.get("kv_pull_fallbacks")
        _settle(prefill, decode)
    assert _counters(prefill)["kv_sent_requests"] == len(LENGTHS) and not _counters(prefill).get("kv_hold_timeouts")


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
    assert after["kv_transferred_tokens"] - before["kv_transferred_tokens"] == len(b) - 1 - 48
    block_bytes = decode.engine.executor.bytes_per_block()
    assert after["kv_bytes_received"] - before["kv_bytes_received"] == 2 * block_bytes  # blocks 3 and 4 only
    _settle(prefill, decode)


def test_corrupt_block_is_detected_and_recomputed(engines):
    prefill, decode, ref = engines
    ids = _prompt(45, seed=7)
    before = _counters(decode).get("kv_pull_fallbacks", 0)
    TcpTransport.corrupt_next_blocks = 1
    try:
        tokens, _ = _disagg(prefill, decode, ids)
    finally:
        TcpTransport.corrupt_next_blocks = 0
    assert tokens == _run(ref, ids, GREEDY)[0]
    assert _counters(decode)["kv_pull_fallbacks"] == before + 1
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
    prefill, decode, ref = (_llm(role, kv_cache_dtype="fp8") for role in ("kv_producer", "kv_consumer", None))
    try:
        assert decode.engine.executor.bytes_per_block() * 4 == _llm_block_bytes_f32()
        for i, n in enumerate((17, 40)):
            ids = _prompt(n, seed=50 + i)
            tokens, _ = _disagg(prefill, decode, ids)
            assert tokens == _run(ref, ids, GREEDY)[0]
        c = _counters(decode)
        assert c["kv_pulls"] == 2 and c["kv_bytes_received"] == 4 * decode.engine.executor.bytes_per_block()
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
    the n - 1 transferred tokens)."""
    n, blocks = len(ids), []
    _, fin = _run(prefill, ids, PREFILL_ONLY, {"do_remote_decode": True})
    sent = _kv_tokens(prefill, fin.kv_transfer_params["remote_block_ids"], n - 1)  # held: not reused yet
    tokens, _ = _run(decode, ids, GREEDY, fin.kv_transfer_params, blocks=blocks, **kw)
    return tokens, sent, _kv_tokens(decode, blocks, n - 1)


def test_int8_kv_transfer_uncalibrated_consumer_adopts_the_producers_scales(int8_producer):
    """A decode engine with no prefill of its own yet takes the producer's scales with the first pull and uses
    the int8 bytes as they arrived (1 byte per value on the wire). Greedy tokens equal a colocated int8 engine
    that calibrated on the same first prompt. (Not its logits bit for bit: a colocated prefill attends to its own
    chunk's unquantized K/V, the decode engine to the stored int8 KV of the n - 1 pulled tokens, as any
    colocated prefix-cache hit does.) Scales that arrive corrupt are caught by their CRC: recomputed."""
    prefill = int8_producer
    decode, ref = _llm("kv_consumer", kv_cache_dtype="int8"), _llm(None, kv_cache_dtype="int8",
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
            assert (kv.num_hits - hits) + (kv.num_external_hits - ext) == n - 1  # computed: the last token only
            assert all(a.dtype == b.dtype == torch.int8 and torch.equal(a, b) for a, b in zip(sent, stored))
            _settle(prefill, decode)
        assert all(torch.equal(a, b) for a, b in zip(_kv_scales(decode), _kv_scales(prefill)))
        c = _counters(decode)
        blocks = sum(-(-(n - 1) // 16) for n in (40, 17, 70))
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
    decode, ref = _llm("kv_consumer", kv_cache_dtype="int8"), _llm(None, kv_cache_dtype="int8",
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
                     ('{"kv_port": -1}', "kv_port"), ('{"kv_rol": "kv_both"}', "unknown")):
        with pytest.raises(ValueError, match=msg):
            KVTransferConfig.parse(bad)
    cfg = EngineConfig.from_kwargs(model=tiny_model("llama"), tensor_parallel_size=2,
                                   kv_transfer_config={"kv_role": "kv_both"})
    with pytest.raises(ValueError, match="tensor or pipeline parallel"):
        cfg._check_parallel_features()


_PRODUCER = r"""
import json, queue, sys, threading
from tokenmill import LLM, SamplingParams
from tokenmill.engine.request import EngineCoreRequest
llm = LLM(sys.argv[1], dtype="float32", device="cpu", num_gpu_blocks_override=48,
          kv_transfer_config={"kv_connector": "TokenmillConnector", "kv_role": "kv_producer"})
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
    proc = subprocess.Popen([sys.executable, "-c", _PRODUCER, tiny_model("llama")], stdin=subprocess.PIPE,
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
            assert (kv.num_hits - hits) + (kv.num_external_hits - ext) == n - 1
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
    a = EngineConfig.from_kwargs(model=tiny("llama"), dtype="float32").finalize()
    b = EngineConfig.from_kwargs(model=str(copy), dtype="float32").finalize()
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

    from tokenmill.kv_transfer.p2p_worker import advertised_host

    assert advertised_host("127.0.0.1") == "127.0.0.1"
    addr = ipaddress.ip_address(advertised_host("0.0.0.0"))
    assert not addr.is_unspecified


def test_transfer_counters_and_time_histogram_reach_metrics():
    """The decode side's pull counters and transfer time histogram in /metrics' Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    from tokenmill.engine.core import EngineStats
    from tokenmill.kv_transfer.p2p_plan import pull_seconds_counters
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
