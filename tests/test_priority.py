"""--scheduling-policy priority: the waiting queue's order, preemption of lower-priority work for a higher-priority
request (KV full, or --max-num-seqs running), unchanged greedy outputs, and the refusals under fcfs."""
import random

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.request_queue import WaitingQueue
from tokenmill.messages import EngineCoreRequest, Request


def _req(rid, priority=0, arrival=0.0):
    return Request(EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=1), [0], arrival,
                                     priority=priority), 64)


def test_queue_orders_by_priority_then_arrival():
    q = WaitingQueue("priority")
    for rid, prio, t in (("a", 5, 1.0), ("b", 0, 2.0), ("c", 5, 0.5), ("d", 0, 3.0), ("e", -1, 4.0)):
        q.add(_req(rid, prio, t))
    assert [r.request_id for r in q] == ["e", "b", "d", "c", "a"]
    first = q.pop()
    q.requeue(first)  # back in its rank's place, not simply at the head
    late = _req("f", 0, 0.1)
    q.add(late)
    assert [r.request_id for r in q] == ["e", "f", "b", "d", "c", "a"]
    q.to_front(next(r for r in q if r.request_id == "a"))  # the quarantine's suspect: first whatever its rank
    assert q.peek().request_id == "a" and len(q) == 6 and late in q
    q.remove(late)
    assert late not in q and [q.pop().request_id for _ in range(5)] == ["a", "e", "b", "d", "c"]


def test_fcfs_queue_puts_returning_requests_at_the_head():
    q = WaitingQueue("fcfs")
    a, b, c = _req("a", 9, 1.0), _req("b", 0, 2.0), _req("c", 0, 3.0)
    q.add(a)
    q.add(b)
    q.requeue(c)
    assert [r.request_id for r in q] == ["c", "a", "b"]


def _engine(tiny, policy, **kw):
    return LLM(tiny("qwen2"), dtype="float32", block_size=16, seed=0, scheduling_policy=policy,
               **{"max_num_batched_tokens": 64, **kw})


def _prompts(n, length, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _add(llm, rid, prompt, max_tokens, priority):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.engine.add_request(EngineCoreRequest(rid, prompt, sp, [0], priority=priority))


def _run(llm, until_first=None):
    """Step until every request finishes: each request's tokens, and the step of `until_first`'s first token."""
    tokens, first_at, step = {}, None, 0
    while llm.engine.has_unfinished_requests():
        step += 1
        for out in llm.engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.request_id == until_first and first_at is None and out.new_token_ids:
                first_at = step
    return tokens, first_at


def _steps_until_decoding(llm, n):
    """Step until n requests have two tokens each: their tokens so far."""
    outs = {}
    while len(outs) < n or any(len(v) < 2 for v in outs.values()):
        for out in llm.engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return outs


@pytest.mark.parametrize("limit", ["kv", "max_num_seqs"])
def test_high_priority_preempts_low_priority_work(tiny, limit):
    """Low-priority requests fill the KV cache (or every sequence slot); a high-priority request that arrives then
    starts at the next step, preempting them, where fcfs makes it wait for their end. Every request's greedy tokens
    are those it gets alone."""
    # kv: 3 x 62 tokens take 12 of 14 blocks when the high-priority request comes, which needs 3
    kw = {"num_gpu_blocks_override": 14} if limit == "kv" else {"num_gpu_blocks_override": 128, "max_num_seqs": 3}
    vocab_probe = _engine(tiny, "fcfs", **kw)
    vocab = vocab_probe.config.model.hf_config.vocab_size
    low, (high,) = _prompts(3, 60, vocab, 1), _prompts(1, 40, vocab, 2)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in
             vocab_probe.generate([{"prompt_token_ids": p} for p in low + [high]], sp, use_tqdm=False)]
    waited = {}
    for policy in ("priority", "fcfs"):
        llm = _engine(tiny, policy, **kw)
        for i, p in enumerate(low):
            _add(llm, f"low{i}", p, 40, 10 if policy == "priority" else 0)
        early = _steps_until_decoding(llm, 3)
        _add(llm, "high", high, 40, 0)
        tokens, waited[policy] = _run(llm, until_first="high")
        for rid, toks in early.items():
            tokens[rid] = toks + tokens.get(rid, [])
        assert [tokens[f"low{i}"] for i in range(3)] + [tokens["high"]] == alone
        assert llm.engine.scheduler.kv.is_whole()
        if policy == "priority":
            assert llm.engine.scheduler.num_preemptions >= 1
    assert waited["priority"] <= 2, waited  # the step it arrived in (its prompt fits one step's budget)
    assert waited["fcfs"] > 10, waited      # behind the low-priority requests' remaining decodes


def test_lower_priority_prefill_yields_the_step(tiny):
    """While a high-priority request waits, a running low-priority request's prefill chunk sits the step out: the
    high one's whole prompt runs in that step (its first token), then the low one's prefill goes on."""
    llm = _engine(tiny, "priority", num_gpu_blocks_override=64)
    vocab = llm.config.model.hf_config.vocab_size
    low, high = _prompts(2, 200, vocab, 4)
    _add(llm, "low", low, 4, 5)
    llm.engine.step()
    sched = llm.engine.scheduler
    assert sched.requests["low"].num_computed_tokens == 64
    _add(llm, "high", high[:60], 4, 0)
    _add(llm, "later-low", high[60:80], 4, 5)  # admitted in a later step, not beside the high one's prefill
    outs = {o.request_id: o for o in llm.engine.step()}
    assert outs["high"].new_token_ids and "low" not in outs
    assert sched.requests["later-low"].num_computed_tokens == 0
    assert sched.requests["low"].num_computed_tokens == 64
    llm.engine.step()
    assert sched.requests["low"].num_computed_tokens > 64
    _run(llm)
    assert sched.kv.is_whole()


def test_lower_priority_decodes_sit_out_a_higher_prompt(tiny):
    """Decoding low-priority requests skip the steps that run a higher-priority prompt (a prompt longer than one
    step's budget takes two), so its first token comes from steps no longer than its own prefill needs; then they
    decode on, with the tokens they get alone."""
    probe = _engine(tiny, "fcfs", num_gpu_blocks_override=64)  # its own engine: no prefix-cache hits below
    vocab = probe.config.model.hf_config.vocab_size
    lows, (high,) = _prompts(2, 20, vocab, 6), _prompts(1, 100, vocab, 7)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in probe.generate([{"prompt_token_ids": p} for p in lows + [high]], sp,
                                                            use_tqdm=False)]
    llm = _engine(tiny, "priority", num_gpu_blocks_override=64)
    for i, p in enumerate(lows):
        _add(llm, f"low{i}", p, 12, 5)
    tokens = _steps_until_decoding(llm, 2)
    _add(llm, "high", high, 12, 0)
    steps = [{o.request_id: o.new_token_ids for o in llm.engine.step()} for _ in range(3)]
    assert [sorted(s) for s in steps] == [[], ["high"], ["high", "low0", "low1"]]  # 64 + 36 prompt tokens
    for s in steps:
        for rid, toks in s.items():
            tokens.setdefault(rid, []).extend(toks)
    rest, _ = _run(llm)
    for rid, toks in rest.items():
        tokens[rid].extend(toks)
    assert [tokens["low0"], tokens["low1"], tokens["high"]] == alone
    assert llm.engine.scheduler.kv.is_whole()


def test_generate_admits_in_priority_order(tiny):
    """One sequence at a time: prompts start lowest priority value first, ties in submission order."""
    llm = _engine(tiny, "priority", num_gpu_blocks_override=64, max_num_seqs=1)
    vocab = llm.config.model.hf_config.vocab_size
    prompts = _prompts(4, 20, vocab, 3)
    for rid, p, prio in zip("abcd", prompts, (5, 0, 5, -2)):
        _add(llm, rid, p, 3, prio)
    order = []
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.request_id not in order:
                order.append(out.request_id)
    assert order == ["d", "b", "a", "c"]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, priority=[3, 1, 2, 0])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3] * 4
    with pytest.raises(ValueError, match="2 priorities"):
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, priority=[1, 2])


def test_fcfs_refuses_a_priority(tiny):
    llm = _engine(tiny, "fcfs", num_gpu_blocks_override=32)
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        _add(llm, "x", [5, 6, 7], 2, 1)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="scheduling-policy"):
        LLM(tiny("qwen2"), dtype="float32", scheduling_policy="lifo")


def test_step_interrupt_trips_only_for_a_better_rank_while_armed():
    from tokenmill.step.interrupt import StepInterrupt, StepInterrupted

    it = StepInterrupt()
    it.offer(-5)
    it.check()  # not armed: an arrival between steps waits for the next schedule, as before
    it.arm(3)
    it.offer(3)
    it.offer(7)
    it.check()  # ties and worse ranks never cut a step short
    it.offer(2)
    with pytest.raises(StepInterrupted):
        it.check()
    it.disarm()
    it.check()


def test_a_better_ranked_arrival_cuts_the_step_short(tiny):
    """A step running low-priority prompt tokens is cut short between layers when a better-ranked request arrives
    during it (in the server, the engine's input thread offers it; here a hook on the first layer does). The step
    emits nothing and counts nothing: the running request's computed tokens go back to where the step started,
    one admitted in the step (its prefix hit was blocks the step was to fill) waits to be admitted again, and those
    blocks leave the prefix cache. The high-priority prompt runs in the next step, and every request gets the
    tokens it gets alone."""
    kw = dict(num_gpu_blocks_override=64, max_num_batched_tokens=128)
    probe = LLM(tiny("qwen2"), dtype="float32", block_size=16, seed=0, **kw)
    vocab = probe.config.model.hf_config.vocab_size
    low0, tail, high = _prompts(3, 200, vocab, 9)
    low1 = low0[:192] + tail[:20]  # shares the 12 blocks low0 fills by the end of its second step
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in probe.generate([{"prompt_token_ids": p} for p in (low0, low1, high[:50])],
                                                            sp, use_tqdm=False)]
    llm = _engine(tiny, "priority", **kw)
    engine, sched = llm.engine, llm.engine.scheduler
    _add(llm, "low0", low0, 8, 5)
    assert engine.step() == [] and sched.requests["low0"].num_computed_tokens == 128
    _add(llm, "low1", low1, 8, 5)  # admitted beside low0's last chunk, with a hit on blocks 0-11
    arrival = engine.executor.collective_rpc(lambda w: w.model)[0].layers[0].register_forward_pre_hook(
        lambda module, args: engine.step_interrupt.offer(0))
    try:
        assert engine.step() == []  # cut short after the first layer
    finally:
        arrival.remove()
    assert sched.num_interrupted_steps == 1 and not sched.in_flight
    assert sched.requests["low0"].num_computed_tokens == 128
    assert sched.requests["low1"].num_computed_tokens == 0 and sched.requests["low1"] in sched.waiting
    _, hit = sched.kv.get_computed_blocks(sched.requests["low1"])
    assert hit == 128  # blocks 8-11 were the cut step's: no longer a prefix hit
    _add(llm, "high", high[:50], 8, 0)
    first = {o.request_id: o.new_token_ids for o in engine.step()}
    assert list(first) == ["high"] and first["high"]
    tokens, _ = _run(llm)
    tokens["high"] = first["high"] + tokens["high"]
    assert [tokens["low0"], tokens["low1"], tokens["high"]] == alone
    assert sched.kv.is_whole()


def test_the_engine_inbox_offers_each_arrival_to_the_step_in_flight():
    """The engine process's input thread (core_proc.Inbox) decodes ADD messages as they come, during a step: each
    request's priority reaches the armed StepInterrupt before the loop takes the message; ABORT and SHUTDOWN
    queue in order behind it."""
    import msgspec
    import zmq

    from tokenmill.engine.core_proc import ABORT, ADD, SHUTDOWN, Inbox
    from tokenmill.step.interrupt import StepInterrupt, StepInterrupted

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    interrupt = StepInterrupt()
    interrupt.arm(5)
    inbox = Inbox(pull, interrupt)
    try:
        enc = msgspec.msgpack.Encoder()
        sp = SamplingParams(max_tokens=1)
        push.send_multipart([ADD, enc.encode([EngineCoreRequest("same", [1, 2], sp, [0], priority=5)])])
        kind, reqs = inbox.get(10.0)
        assert kind == ADD and [r.request_id for r in reqs] == ["same"]
        interrupt.check()  # a tie does not cut the step
        push.send_multipart([ADD, enc.encode([EngineCoreRequest("urgent", [1, 2], sp, [0], priority=0)])])
        push.send_multipart([ABORT, enc.encode(["same"])])
        push.send_multipart([SHUTDOWN])
        kind, reqs = inbox.get(10.0)
        assert kind == ADD and reqs[0].request_id == "urgent"
        with pytest.raises(StepInterrupted):
            interrupt.check()
        assert inbox.get(10.0) == (ABORT, ["same"]) and inbox.get(10.0) == (SHUTDOWN, None)
    finally:
        inbox.close()
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()
