"""The fleet's pure parts: the autoscaler's decisions (with an explicit clock), --target and --group parsing,
group weights and the recent-latency window. The fleet itself runs real replicas in test_fleet.py."""
from __future__ import annotations

import pytest

from tokenmill.fleet.autoscale import Autoscaler, Signals, Target, parse_targets
from tokenmill.fleet.groups import GroupSpec, group_weights, parse_group
from tokenmill.fleet.launchers import parse_launch
from tokenmill.router.metrics import LatencyWindow


def test_parse_targets():
    assert parse_targets([]) == Target(queue=4.0)
    assert parse_targets(["ttft_p90=2s", "queue=3", "kv_usage=0.8"]) == Target(2.0, 3.0, 0.8)
    assert parse_targets(["ttft_p90=500ms"]).ttft_p90 == 0.5
    for bad in ("ttft=2s", "queue=-1", "kv_usage=2", "queue", "queue=abc"):
        with pytest.raises(ValueError, match="--target"):
            parse_targets([bad])


def test_autoscaler_scales_up_early_and_proportionally():
    a = Autoscaler(Target(queue=2.0), 1, 5, cooldown=10)
    assert a.decide(Signals(1, 1.0, 0.0, None), 0) == 1        # 50% of the target: hold
    assert a.decide(Signals(1, 1.7, 0.0, None), 1) == 2        # 85%: up before the target breaks
    assert a.decide(Signals(1, 8.0, 0.0, None), 2) == 5        # 4x over: straight to 5 (ceil(1 * 4 / 0.8))
    assert a.decide(Signals(2, 40.0, 0.0, None), 3) == 5       # capped at max
    assert a.decide(Signals(0, 0.0, 0.0, None), 4) == 1        # all gone: back to min


def test_autoscaler_uses_every_target():
    a = Autoscaler(Target(ttft_p90=2.0, queue=10.0, kv_usage=0.5), 1, 4)
    assert a.decide(Signals(2, 2.0, 0.1, 3.0), 0) == 4         # TTFT P90 at 150% of its target
    assert a.decide(Signals(2, 2.0, 0.45, None), 0) == 3       # KV at 90% of its target
    assert a.pressure(Signals(2, 2.0, 0.1, None)) == pytest.approx(0.2)  # no TTFT sample: not counted


def test_autoscaler_scales_down_one_step_per_cooldown():
    a = Autoscaler(Target(queue=4.0), 1, 3, cooldown=10)
    calm = Signals(3, 0.0, 0.0, None)
    assert a.decide(calm, 100) == 3                            # the lull starts
    assert a.decide(calm, 109) == 3                            # not calm for long enough
    assert a.decide(Signals(3, 7.0, 0.0, None), 109.5) == 3    # a busy moment (58%) restarts the clock
    assert a.decide(calm, 110) == 3 and a.decide(calm, 119) == 3
    assert a.decide(calm, 120.5) == 2                          # 10 s calm: one step down
    assert a.decide(Signals(2, 0.0, 0.0, None), 125) == 2      # the next step waits a full cool-down
    assert a.decide(Signals(2, 0.0, 0.0, None), 131) == 1
    assert a.decide(Signals(1, 0.0, 0.0, None), 200) == 1      # never under min


def test_autoscaler_checks_bounds():
    with pytest.raises(ValueError, match="min-replicas"):
        Autoscaler(Target(queue=1), 3, 2)


def test_parse_group_and_weights():
    assert parse_group("canary=http://10.0.0.3:8000:5%") == GroupSpec("canary", ["http://10.0.0.3:8000"],
                                                                      None, 5.0)
    assert parse_group("stable=http://a:1/,http://b:2") == GroupSpec("stable", ["http://a:1", "http://b:2"])
    launched = parse_group("canary=tokenmill serve --dtype float32 --max-num-seqs 8:12.5%")
    assert launched.launch == ["--dtype", "float32", "--max-num-seqs", "8"] and launched.percent == 12.5
    for bad in ("canary", "canary=ftp://x", "canary=http://a:1:150%", "canary=tokenmill serve --port 1"):
        with pytest.raises(ValueError, match="--group"):
            parse_group(bad)
    specs = [parse_group("canary=http://c:1:10%"), parse_group("blue=http://b:1")]
    assert group_weights(specs, default_present=True) == pytest.approx({"canary": 0.1, "blue": 0.45,
                                                                        "default": 0.45})
    with pytest.raises(ValueError, match="more than 100%"):
        group_weights([parse_group("a=http://a:1:60%"), parse_group("b=http://b:1:50%")], False)
    with pytest.raises(ValueError, match="twice"):
        group_weights([parse_group("default=http://a:1")], True)


def test_parse_launch_errors_name_the_problem():
    assert parse_launch("tokenmill serve model.gguf --dtype float32") == ["model.gguf", "--dtype", "float32"]
    with pytest.raises(ValueError, match="expects a `tokenmill serve"):
        parse_launch("vllm serve x")
    with pytest.raises(ValueError, match="--port is set by the launcher"):
        parse_launch("tokenmill serve --port 8001")
    with pytest.raises(ValueError, match="unrecognized arguments: --bogus"):
        parse_launch("tokenmill serve --bogus")


def test_latency_window_percentile_forgets_old_samples():
    w = LatencyWindow(seconds=10)
    assert w.percentile(0.9, now=0) is None
    for i in range(10):
        w.add(float(i + 1), now=i)
    assert w.percentile(0.9, now=9) == 10.0 and w.percentile(0.5, now=9) == 6.0
    assert w.percentile(0.9, now=14.5) == 10.0 and len(w.samples) == 5  # samples older than 10 s are gone


def test_pool_counts_misses_in_a_row_and_replicas_join_and_leave():
    """The grace period's input (failures in a row, reset by a success), draining, and run-time add/remove,
    against replicas answered in-process (the fleet's real-process tests are in test_fleet.py)."""
    import asyncio

    import httpx

    from tokenmill.config import RouterConfig
    from tokenmill.router.forward import Router

    down: set[str] = set()

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host in down:
            raise httpx.ConnectTimeout("timed out", request=request)
        return httpx.Response(200, text="")

    router = Router(RouterConfig(replicas=["http://a:1"]).validate(),
                    httpx.AsyncClient(transport=httpx.MockTransport(answer)))

    async def scenario():
        a = router.pool.replicas[0]
        b = router.add_replica("http://b:1/", "canary")
        await router.pool.probe_all()
        assert [r.url for r in router.pool.healthy()] == ["http://a:1", "http://b:1"] and b.group == "canary"
        down.add("b")
        for misses in (1, 2, 3):
            await router.pool.probe_all()
            assert b.failures == misses and not b.healthy and a.failures == 0
        down.clear()
        await router.pool.probe_all()
        assert b.failures == 0 and b.healthy
        b.draining = True  # probed, healthy, but no new requests
        await router.pool.probe_all()
        assert router.pool.healthy() == [a]
        router.remove_replica(b)
        assert router.pool.replicas == [a] and router.pool.get("http://b:1") is None
        await router.aclose()

    asyncio.run(scenario())


def test_group_draw_follows_the_weights():
    from tokenmill.config import RouterConfig
    from tokenmill.router.forward import Router

    router = Router(RouterConfig(replicas=["http://a:1", "http://b:1", "http://c:1"]).validate(),
                    groups={"http://c:1": "canary"}, weights={"default": 0.9, "canary": 0.1})
    for r in router.pool.replicas:
        r.healthy = True
    router.rng.seed(0)
    picks = [router.pick_group(router.pool.healthy()) for _ in range(2000)]
    canary = sum(p == [router.pool.replicas[2]] for p in picks)
    assert all(p in ([router.pool.replicas[2]], router.pool.replicas[:2]) for p in picks)
    assert 150 < canary < 250  # 10% of 2000 = 200, sd 13
    down_default = [router.pool.replicas[2]]  # only the canary is up: it takes everything
    assert router.pick_group(down_default) == down_default


def test_router_flags_build_the_fleets():
    """--launch is the autoscaled `default` fleet, a --group with a serve command a fleet of one replica;
    nothing starts until the router runs."""
    from tokenmill.cli import build_parser
    from tokenmill.fleet.router_command import make_fleets, router_from_args

    argv = ["router", "--launch", "tokenmill serve --dtype float32", "--min-replicas", "1", "--max-replicas", "3",
            "--target", "ttft_p90=2s", "--group", "canary=tokenmill serve --dtype float32 --max-num-seqs 8:10%",
            "--replica-threads", "1"]
    args = build_parser("router").parse_args(argv)
    groups = [parse_group(v) for v in args.group]
    router = router_from_args(args, groups)
    assert router.weights == pytest.approx({"canary": 0.1, "default": 0.9}) and router.pool.replicas == []
    default, canary = make_fleets(args, router, groups)
    assert (default.group, default.argv, default.size) == ("default", ["--dtype", "float32"], 1)
    assert default.autoscaler.max == 3 and default.autoscaler.target == Target(ttft_p90=2.0)
    assert (canary.group, canary.argv[-2:], canary.size, canary.autoscaler) == ("canary", ["--max-num-seqs", "8"],
                                                                               1, None)
    bad = build_parser("router").parse_args(["router", "--replica", "http://a:1", "--max-replicas", "3"])
    with pytest.raises(ValueError, match="need --launch"):
        make_fleets(bad, router_from_args(bad, []), [])


def test_upgrade_command_errors_are_one_line(capsys):
    from tokenmill.cli import main

    assert main(["upgrade", "--router", "http://127.0.0.1:9", "--launch", "vllm serve x"]) == 2
    assert "expects a `tokenmill serve ...` command" in capsys.readouterr().err
    assert main(["upgrade", "--router", "http://127.0.0.1:9", "--launch", "tokenmill serve"]) == 2
    assert "could not reach the router" in capsys.readouterr().err
