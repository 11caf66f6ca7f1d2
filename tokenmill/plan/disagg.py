"""`tokenmill plan --disaggregate xPyD`: colocated vs disaggregated prefill/decode, from the roofline and queues.

The same hardware is served two ways. On catalog hardware that is x + y instances of TP devices each, every one
running both phases (colocated) or one phase (xPyD). On local-cpu it is this one machine, as `tokenmill serve`
and `tokenmill serve --disaggregate xPyD` run it: colocated is one instance with all the cores; xPyD is x + y
instances with 1/(x+y) of the cores each, i.e. that share of the measured FLOP/s and memory bandwidth.

- **colocated**: every instance runs both phases. Chunked prefill: a step carries the running decodes (batch B,
  one token each) plus up to `--max-num-batched-tokens` tokens of a waiting prompt. A step is the roofline of
  everything in it (weights read once; FLOPs of every token) + its TP communication, so a step that carries a
  prompt chunk lasts about as long as the chunk's compute (compute-bound) and every decode in it waits that
  long for its next token. Each running request gets one token per step, so its inter-token gaps *are* the
  step durations: ITL P50/P99 are the 50th/99th percentiles of the step durations, weighted by how often each
  kind of step runs (decode-only steps, and each chunk of each prompt class). When more than 1% of the steps
  carry a chunk, ITL P99 is a chunk's step.
- **xPyD**: x prefill instances run prompts only (the same chunks, no decodes), then send the prompt's KV to
  one of y decode instances, which run decode-only steps: ITL = the decode step, with no prefill in it.

Traffic: Poisson arrivals at `--request-rate`, spread evenly over the instances that serve them; prompts of
`--input-len` tokens, a `--long-fraction` of them `--long-input-len` tokens; `--output-len` tokens each.
Queues: the prefill work of an instance (its prompt chunks, first come first served) is an M/G/1 queue:
mean wait = lambda E[S^2] / (2 (1 - rho)) (Pollaczek-Khinchine), P99 wait from the exponential tail
P(W > t) ~ rho exp(-t rho / E[W]). The decode batch B per instance is what Little's law needs:
B x (steps per second) = requests/s x (output_len - 1) tokens, solved for B; a pool saturates when its
prefill work reaches 100% of its time or B outgrows the KV room.
KV transfer: prompt tokens x KV bytes per token, each of the TP ranks sending its shard over its own link
(`--network`, default InfiniBand-NDR at its link rate, as an RDMA transport reaches; `--network nvlink` when
both pools share an NVLink domain), after the prefill and not overlapped with it (added to TTFT); the first
token reaches the client after the transfer. On local-cpu the link is measured now (kv_link.py: tokenmill's
own gather + TCP + CRC + copy path over loopback, a few hundred MB/s, not a nominal memory-copy rate).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from tokenmill.perf.hardware import Hardware, Interconnect, default_links
from tokenmill.perf.memory import ModelShape, memory_plan
from tokenmill.perf.parallel import Split, check_split, comm_per_token, comm_time, device_memory
from tokenmill.perf.roofline import roofline_time, step_cost

PAYS_MARGIN = 1.2  # xPyD "pays" on latency when colocated ITL P99 is at least this many times xPyD's

ASSUMPTIONS = [
    "step time = roofline (compute-bound prefill, memory-bound decode) + TP communication; no kernel overheads",
    "Poisson arrivals spread evenly over instances; each instance's prompt chunks are an M/G/1 queue",
    "colocated: chunked prefill, one chunk per step beside every running decode (ITL = step durations)",
    "xPyD: decode steps carry no prefill; KV sent after the prefill, not overlapped, each TP rank on its own link",
    "local-cpu: colocated = one instance with every core; xPyD = x + y instances splitting the cores evenly",
    f"'pays' = colocated ITL P99 >= {PAYS_MARGIN:g} x xPyD's, or colocated saturates and xPyD does not",
]


def parse_xpyd(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*[pP]\s*(\d+)\s*[dD]\s*", text or "")
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"--disaggregate takes xPyD: x >= 1 prefill and y >= 1 decode instances "
                         f"(e.g. 1P1D, 2P4D), got {text!r}")
    return int(m[1]), int(m[2])


@dataclass(frozen=True)
class Traffic:
    rate: float                 # requests/s, all instances together
    input_len: int
    output_len: int
    long_fraction: float = 0.0
    long_input_len: Optional[int] = None

    def __post_init__(self) -> None:
        if self.rate < 0 or self.input_len < 1:
            raise ValueError("--request-rate must be >= 0 and --input-len >= 1")
        if self.output_len < 2:
            raise ValueError("--disaggregate compares inter-token latency: --output-len must be at least 2")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"--long-fraction must be in [0, 1], got {self.long_fraction}")
        if self.long_fraction > 0 and not self.long_input_len:
            raise ValueError("--long-fraction needs --long-input-len (the long prompts' tokens)")
        if self.long_input_len is not None and self.long_input_len < 1:
            raise ValueError(f"--long-input-len must be at least 1, got {self.long_input_len}")

    @property
    def classes(self) -> list[tuple[float, int]]:
        """(share, prompt tokens) of each kind of request."""
        out = [(1.0 - self.long_fraction, self.input_len), (self.long_fraction, self.long_input_len or 0)]
        return [(p, n) for p, n in out if p > 0]

    @property
    def mean_input(self) -> float:
        return sum(p * n for p, n in self.classes)

    @property
    def decode_context(self) -> float:
        """Mean tokens a decode step attends over per request: the prompt plus half the output."""
        return self.mean_input + self.output_len / 2

    def replace(self, **kw: Any) -> "Traffic":
        return dataclasses.replace(self, **kw)


class Instance:
    """Step times of one instance of `tp` devices: the roofline over its devices plus TP communication."""

    def __init__(self, shape: ModelShape, hw: Hardware, tp: int, weight_dtype: str, kv_dtype: str,
                 compute_dtype: str, chunk: int, memory_utilization: float = 0.9,
                 node_link: Optional[Interconnect] = None, instances: int = 1) -> None:
        self.shape, self.hw, self.tp, self.chunk = shape, hw, tp, chunk
        self.weight_dtype, self.kv_dtype = weight_dtype, kv_dtype
        self.split = Split(tp)
        check_split(shape, self.split)
        self.compute_dtype, peak1 = hw.peak_flops(compute_dtype)
        self.peak, self.bandwidth = peak1 * tp, hw.bandwidth * tp
        self.node_link = node_link or default_links(hw)[0]
        self.comm = comm_per_token(shape, self.split, weight_dtype)
        # the local CPU's instances are processes sharing this machine's memory
        device_bytes = hw.memory_bytes / (tp * instances) if hw.name == "local-cpu" else hw.memory_bytes
        mem = device_memory(shape, self.split, weight_dtype, kv_dtype, device_bytes, memory_utilization, 1, chunk, 1)
        self.kv_tokens = mem["kv_tokens"]          # tokens of KV the instance holds (each rank its shard)

    def step(self, tokens: float, pairs: float, kv_read: float, sampled: float, decode: bool = False) -> float:
        t = roofline_time(step_cost(self.shape, tokens, pairs, kv_read, self.weight_dtype, self.kv_dtype, decode,
                                    logits_tokens=sampled),
                          self.peak, self.bandwidth)
        if self.tp > 1:
            t += comm_time(self.comm, self.split, tokens, sampled, self.node_link, self.node_link,
                           max(self.tp, 8))["total_s"]
        return t

    def decode_step(self, batch: float, context: float) -> float:
        return self.step(batch, batch * context, batch * context, batch, decode=True)

    def prefill_chunks(self, prompt: int, batch: float = 0.0, context: float = 0.0) -> list[float]:
        """Durations of the steps that prefill a prompt in chunks of `chunk` tokens, each beside `batch`
        decodes at mean `context` (colocated) or alone (batch 0, a prefill instance)."""
        out = []
        for start in range(0, prompt, self.chunk):
            n = min(self.chunk, prompt - start)
            out.append(self.step(n + batch, n * start + n * (n + 1) / 2 + batch * context,
                                 start + batch * context, batch + 1))
        return out


def kv_transfer(shape: ModelShape, kv_dtype: str, prompt: int, tp: int, link: Interconnect) -> tuple[int, float]:
    """(bytes, seconds) to move one request's prompt KV: every TP rank sends its shard on its own link."""
    nbytes = shape.kv_bytes_per_token(kv_dtype) * prompt
    return nbytes, link.latency + nbytes / (tp * link.bandwidth)


def mg1(lam: float, services: list[tuple[float, float]]) -> dict[str, float]:
    """M/G/1 with arrival rate `lam` and service times `services` [(share, seconds)]: utilisation, mean wait
    (Pollaczek-Khinchine) and a P99 wait from the exponential tail P(W > t) ~ rho exp(-t rho / E[W])."""
    es = sum(p * s for p, s in services)
    es2 = sum(p * s * s for p, s in services)
    rho = lam * es
    if rho >= 1:
        return {"rho": rho, "wait_s": math.inf, "wait_p99_s": math.inf}
    wait = lam * es2 / (2 * (1 - rho))
    p99 = wait / rho * math.log(100 * rho) if rho > 0.01 else 0.0
    return {"rho": rho, "wait_s": wait, "wait_p99_s": p99}


def quantile(weighted: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of values given as [(weight, value)]."""
    items = sorted((v, w) for w, v in weighted if w > 0)
    total = sum(w for _, w in items)
    if not items:
        return 0.0
    acc = 0.0
    for v, w in items:
        acc += w
        if acc >= q * total * (1 - 1e-12):
            return v
    return items[-1][0]


def _solve(f: Callable[[float], float], target: float, hi: float, iters: int = 80) -> Optional[float]:
    """Smallest x in [0, hi] with f(x) >= target for an increasing f; None when f(hi) < target."""
    if target <= 0:
        return 0.0
    if f(hi) < target:
        return None
    lo = 0.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if f(mid) >= target else (mid, hi)
    return hi


def _ttft(queue: dict, classes: list[tuple[float, int]], service: dict[int, float],
          extra: dict[int, float]) -> dict[str, Any]:
    per = {n: queue["wait_s"] + service[n] + extra.get(n, 0.0) for _, n in classes}
    mean = sum(p * per[n] for p, n in classes)
    # the P99 request: the prompt class at the 99th percentile of its own time, after a P99 wait
    p99_own = quantile([(p, service[n] + extra.get(n, 0.0)) for p, n in classes], 0.99)
    return {"mean_s": mean, "p99_s": queue["wait_p99_s"] + p99_own, "by_prompt_len": per}


def colocated(inst: Instance, n_inst: int, traffic: Traffic) -> dict[str, Any]:
    """n_inst instances each running both phases at rate / n_inst."""
    lam = traffic.rate / n_inst
    ctx, gen = traffic.decode_context, traffic.output_len - 1
    cap_b = inst.kv_tokens / ctx

    def at(b: float) -> dict[str, Any]:
        chunks = {n: inst.prefill_chunks(n, b, ctx) for _, n in traffic.classes}
        rho = lam * sum(p * sum(chunks[n]) for p, n in traffic.classes)
        mixed = lam * sum(p * len(chunks[n]) for p, n in traffic.classes)
        t_d = inst.decode_step(b, ctx)
        decode_only = max(0.0, 1.0 - rho) / t_d
        return {"chunks": chunks, "rho": rho, "mixed": mixed, "t_d": t_d, "decode_only": decode_only,
                "tokens_per_s": b * (mixed + decode_only)}

    b = _solve(lambda x: at(x)["tokens_per_s"], lam * gen, cap_b) if lam > 0 else 0.0
    s = at(b if b is not None else cap_b)
    prefill_saturated = s["rho"] >= 1
    out: dict[str, Any] = {"instances": n_inst, "rate_per_instance": lam, "decode_batch": b,
                           "decode_batch_max": cap_b, "prefill_busy": s["rho"], "saturated": False}
    if prefill_saturated or b is None:
        out.update(saturated=True, why="prefill work exceeds each instance's time" if prefill_saturated
                   else "the decode batch outgrows the KV room")
        return out
    steps = [(s["decode_only"], s["t_d"])]
    for p, n in traffic.classes:
        steps += [(lam * p, t) for t in s["chunks"][n]]
    total = sum(r for r, _ in steps)
    queue = mg1(lam, [(p, sum(s["chunks"][n])) for p, n in traffic.classes])
    longest_chunk = max(t for ts in s["chunks"].values() for t in ts)
    out.update(
        decode_step_s=s["t_d"], chunk_step_s=longest_chunk,
        mixed_step_fraction=s["mixed"] / total if total else 0.0,
        itl_p50_s=quantile(steps, 0.5), itl_p99_s=quantile(steps, 0.99),
        itl_mean_s=sum(r * t for r, t in steps) / total if total else s["t_d"],
        queue=queue, ttft=_ttft(queue, traffic.classes, {n: sum(s["chunks"][n]) for _, n in traffic.classes}, {}),
        output_tokens_per_s=traffic.rate * traffic.output_len)
    return out


def disaggregated(inst: Instance, x: int, y: int, traffic: Traffic, link: Interconnect,
                  receive_on_decode_cores: bool = False) -> dict[str, Any]:
    """x prefill instances (prompts only) and y decode instances (decode-only steps), KV sent between them.

    receive_on_decode_cores (local-cpu): the KV a decode instance pulls is received, checked and copied in by its
    own cores (kv_link.py's path is CPU work), so for the transfer's duration its decode steps wait: each
    pull stretches the step beside it by the transfer time, as a prompt chunk does in a colocated step. (An
    RDMA transport on GPUs writes the KV without the decode GPU's compute: no stall.)"""
    ctx, gen = traffic.decode_context, traffic.output_len - 1
    lam_p, lam_d = traffic.rate / x, traffic.rate / y
    service = {n: sum(inst.prefill_chunks(n)) for _, n in traffic.classes}
    transfer = {n: kv_transfer(inst.shape, inst.kv_dtype, n, inst.tp, link) for _, n in traffic.classes}
    queue = mg1(lam_p, [(p, service[n]) for p, n in traffic.classes])
    link_busy = lam_p * sum(p * transfer[n][1] for p, n in traffic.classes)
    stalls = [(lam_d * p, transfer[n][1]) for p, n in traffic.classes] if receive_on_decode_cores else []
    receiving = sum(r * t for r, t in stalls)              # share of a decode instance's time spent receiving
    cap_b = inst.kv_tokens / ctx

    def tokens_per_s(v: float) -> float:                   # decode steps run when not receiving; a stall's too
        return v * (max(0.0, 1.0 - receiving) / inst.decode_step(v, ctx) + sum(r for r, _ in stalls))

    capacity = tokens_per_s(cap_b)                         # decode tokens/s per instance at a full KV
    b = _solve(tokens_per_s, lam_d * gen, cap_b) if lam_d > 0 and receiving < 1 else (0.0 if lam_d == 0 else None)
    prefill = {"instances": x, "rate_per_instance": lam_p, "busy": queue["rho"], "link_busy": link_busy,
               "service_s": service, "saturated": queue["rho"] >= 1 or link_busy >= 1}
    decode = {"instances": y, "rate_per_instance": lam_d, "decode_batch": b, "decode_batch_max": cap_b,
              "busy": lam_d * gen / capacity if capacity else math.inf, "receiving": receiving,
              "saturated": b is None}
    out: dict[str, Any] = {
        "prefill": prefill, "decode": decode, "kv_link": link.name,
        "kv_bytes_per_request": {n: transfer[n][0] for _, n in traffic.classes},
        "kv_transfer_s": {n: transfer[n][1] for _, n in traffic.classes},
        "saturated": prefill["saturated"] or decode["saturated"]}
    if not prefill["saturated"]:
        out["ttft"] = _ttft(queue, traffic.classes, service, {n: transfer[n][1] for _, n in traffic.classes})
        out["queue"] = queue
    if b is not None:
        t = inst.decode_step(b, ctx)
        steps = [(max(0.0, 1.0 - receiving) / t, t)] + [(r, t + s) for r, s in stalls]
        total = sum(r for r, _ in steps)
        decode["step_s"] = t
        out.update(itl_p50_s=quantile(steps, 0.5), itl_p99_s=quantile(steps, 0.99),
                   itl_mean_s=sum(r * d for r, d in steps) / total if total else t)
    if not out["saturated"]:
        out["output_tokens_per_s"] = traffic.rate * traffic.output_len
    return out


def _max_rate(saturated: Callable[[float], bool]) -> float:
    """The highest request rate that does not saturate (bisection; saturation grows with the rate)."""
    hi = 1.0
    while not saturated(hi) and hi < 1e7:
        hi *= 2
    lo = 0.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if not saturated(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class Layouts:
    """The two ways of serving the same hardware: `colocated_instances` of `colocated` vs xPyD of `disaggregated`."""
    colocated: Instance
    colocated_instances: int
    disaggregated: Instance
    receive_on_decode_cores: bool = False   # local-cpu: see disaggregated()

    def colocate(self, traffic: Traffic) -> dict[str, Any]:
        return colocated(self.colocated, self.colocated_instances, traffic)

    def xpyd(self, x: int, y: int, traffic: Traffic, link: Interconnect) -> dict[str, Any]:
        return disaggregated(self.disaggregated, x, y, traffic, link, self.receive_on_decode_cores)


def layouts(shape: ModelShape, hw: Hardware, x: int, y: int, tp: int, node_link: Optional[Interconnect] = None,
            **kw: Any) -> Layouts:
    """Catalog hardware: x + y instances of tp devices either way. local-cpu: one machine, so colocated is one
    instance of tp ranks over all its cores, xPyD x + y instances of tp ranks over 1/(x+y) of them each."""
    def make(device: Hardware, instances: int) -> Instance:
        return Instance(shape, device, tp, node_link=node_link, instances=instances, **kw)

    if hw.name != "local-cpu":
        inst = make(hw, x + y)
        return Layouts(inst, x + y, inst)
    return Layouts(make(hw.share(1 / tp), 1), 1, make(hw.share(1 / (tp * (x + y))), x + y), True)


def compare(lay: Layouts, x: int, y: int, traffic: Traffic, link: Interconnect) -> dict[str, Any]:
    co = lay.colocate(traffic)
    dis = lay.xpyd(x, y, traffic, link)
    if dis["saturated"]:
        pays = False
    elif co["saturated"]:
        pays = True
    else:
        pays = co["itl_p99_s"] >= PAYS_MARGIN * dis["itl_p99_s"]
    return {"colocated": co, "disaggregated": dis, "pays": pays}


def _first_flip(pays: Callable[[float], bool], grid: list[float]) -> Optional[float]:
    """The smallest value on the grid (refined between grid points) where `pays` turns true."""
    prev = None
    for v in grid:
        if pays(v):
            if prev is None:
                return v
            lo, hi = prev, v
            for _ in range(30):
                mid = (lo + hi) / 2
                lo, hi = (lo, mid) if pays(mid) else (mid, hi)
            return hi
        prev = v
    return None


def disagg_plan(shape: ModelShape, hw: Hardware, x: int, y: int, traffic: Traffic, tp: Optional[int] = None,
                weight_dtype: str = "bf16", kv_dtype: str = "bf16", compute_dtype: str = "bf16",
                chunk: int = 2048, memory_utilization: float = 0.9, link: Optional[Interconnect] = None,
                node_link: Optional[Interconnect] = None) -> dict[str, Any]:
    """The whole comparison as a JSON-ready dict (see the module docstring for the model)."""
    if chunk < 1:
        raise ValueError(f"--max-num-batched-tokens must be at least 1, got {chunk}")
    tp = tp or instance_tp(shape, hw, weight_dtype)
    local = hw.name == "local-cpu"
    link = link or _kv_link(shape, hw, kv_dtype, tp * (x + y))
    lay = layouts(shape, hw, x, y, tp, node_link, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                  compute_dtype=compute_dtype, chunk=chunk, memory_utilization=memory_utilization)
    inst = lay.disaggregated
    if inst.kv_tokens < traffic.decode_context:
        raise ValueError(f"{shape.name} on {tp} x {hw.name}: the weights leave no KV room for one request of "
                         f"{traffic.decode_context:.0f} tokens; use a larger -tp")
    here = compare(lay, x, y, traffic, link)
    co_max = _max_rate(lambda r: lay.colocate(traffic.replace(rate=r))["saturated"])
    dis_max = _max_rate(lambda r: lay.xpyd(x, y, traffic.replace(rate=r), link)["saturated"])

    best = None
    if x + y <= 32:  # the xPyD of the same instances that keeps up with the most traffic
        rates = {(a, x + y - a): dis_max if a == x else
                 _max_rate(lambda r, a=a: lay.xpyd(a, x + y - a, traffic.replace(rate=r), link)["saturated"])
                 for a in range(1, x + y)}
        (bx, by), brate = max(rates.items(), key=lambda kv: kv[1])
        best = {"xpyd": f"{bx}P{by}D", "max_rate": brate}

    def pays_at(r: float) -> bool:
        return compare(lay, x, y, traffic.replace(rate=r), link)["pays"]

    top = max(dis_max, 1e-9)
    grid = [top * 10 ** (-3 + 3 * i / 120) for i in range(121)][:-1]
    break_even_rate = _first_flip(pays_at, grid)
    break_even_long = None
    if traffic.long_input_len:
        def pays_long(f: float) -> bool:
            return compare(lay, x, y, traffic.replace(long_fraction=f), link)["pays"]

        break_even_long = _first_flip(pays_long, [i / 100 for i in range(101)])
    plan = {
        "model": shape.name, "hardware": hw.name, "xpyd": f"{x}P{y}D", "prefill_instances": x,
        "decode_instances": y, "tp": tp, "devices": (x + y) * tp, "weight_dtype": weight_dtype, "kv_dtype": kv_dtype,
        "compute_dtype": inst.compute_dtype, "chunk_tokens": chunk, "kv_tokens_per_instance": inst.kv_tokens,
        "kv_link": link.name, "kv_link_bandwidth": link.bandwidth, "kv_link_latency": link.latency,
        "kv_link_about": link.about,
        "kv_bytes_per_token": shape.kv_bytes_per_token(kv_dtype),
        "traffic": dataclasses.asdict(traffic), "classes": traffic.classes,
        **here, "colocated_max_rate": co_max, "disaggregated_max_rate": dis_max,
        "break_even_rate": break_even_rate, "break_even_long_fraction": break_even_long,
        "best_split": best,
        "assumptions": ASSUMPTIONS, "notes": [],
    }
    if local:
        threads = hw.details.get("threads")
        plan["notes"].append(f"local-cpu: colocated is one instance with the whole measured CPU ({threads} threads); "
                             f"each of {x}P{y}D's {x + y} instances gets 1/{x + y} of its FLOP/s and memory "
                             f"bandwidth. KV link {link.about}")
    plan["verdict"] = verdict(plan)
    return plan


def _kv_link(shape: ModelShape, hw: Hardware, kv_dtype: str, ranks: int) -> Interconnect:
    """The default KV link: between nodes for catalog hardware; on local-cpu, measured now at one of the
    `ranks` processes' share of the threads (kv_link.py)."""
    if hw.name != "local-cpu":
        return default_links(hw)[1]
    from tokenmill.plan.kv_link import measure_kv_loopback  # imports torch: only a local-cpu plan measures it

    return measure_kv_loopback(shape, kv_dtype, threads=int(hw.details.get("threads", 1)) // ranks)


def instance_tp(shape: ModelShape, hw: Hardware, weight_dtype: str) -> int:
    """The smallest TP size the engine accepts whose devices hold the weights with KV headroom (memory >=
    1.5 x weights, the plan's `min GPUs` rule)."""
    need = memory_plan(shape, weight_dtype, "bf16", 1, hw.memory_bytes).min_gpus  # KV dtype: no matter here
    for tp in range(need, 257):
        try:
            check_split(shape, Split(tp))
            return tp
        except ValueError:
            continue
    raise ValueError(f"{shape.name}: no TP size from {need} up to 256 divides the model")


def _ms(s: float) -> str:
    return "inf" if math.isinf(s) else f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


def _rate(r: float) -> str:
    return f"{r:.3g} req/s"


def verdict(p: dict[str, Any]) -> str:
    co, dis, rate = p["colocated"], p["disaggregated"], p["traffic"]["rate"]
    pre, dec = dis["prefill"], dis["decode"]
    at = f"at {_rate(rate)}"
    if dis["saturated"] and co["saturated"]:
        return f"neither keeps up {at}: colocated serves up to {_rate(p['colocated_max_rate'])}, " \
               f"{p['xpyd']} up to {_rate(p['disaggregated_max_rate'])}; add instances"
    if dis["saturated"]:
        pool = "prefill" if pre["saturated"] else "decode"
        busy = pre["busy"] if pool == "prefill" else dec["busy"]
        return (f"disaggregation does not pay here: {at} the {pool} pool of {p['xpyd']} saturates "
                f"({busy:.0%} busy) while colocated keeps up (to {_rate(p['colocated_max_rate'])})")
    if co["saturated"]:
        return (f"pays: colocated cannot keep up {at} (it serves up to {_rate(p['colocated_max_rate'])}), "
                f"{p['xpyd']} can (to {_rate(p['disaggregated_max_rate'])}) with ITL P99 {_ms(dis['itl_p99_s'])}")
    ttft = f"TTFT mean {_ms(co['ttft']['mean_s'])} colocated vs {_ms(dis['ttft']['mean_s'])}"
    if p["pays"]:
        return (f"pays: colocated ITL P99 {_ms(co['itl_p99_s'])} vs {_ms(dis['itl_p99_s'])} disaggregated "
                f"{at} ({ttft}; prefill pool {pre['busy']:.0%} busy, decode pool {dec['busy']:.0%})")
    when = (f"; it would pay from {_rate(p['break_even_rate'])}" if p["break_even_rate"] is not None
            else "; it pays at no rate this setup sustains")
    return (f"disaggregation wastes hardware here: {at} the prefill pool is {pre['busy']:.0%} busy and the decode "
            f"pool {dec['busy']:.0%}, colocated ITL P99 is {_ms(co['itl_p99_s'])} vs {_ms(dis['itl_p99_s'])} "
            f"disaggregated ({ttft}){when}")


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


def _colocated_lines(p: dict[str, Any]) -> list[str]:
    co = p["colocated"]
    lines = []
    n_co = co["instances"]
    lines.append(f"  colocated         {n_co} instance{'s' if n_co > 1 else ''}"
                 + (" with every core" if p["hardware"] == "local-cpu" else "")
                 + ", each prefill chunk shares its step with the running decodes")
    if co["saturated"]:
        lines.append(f"    saturated       {co['why']} (prefill {co['prefill_busy']:.0%} of the time); keeps up to "
                     f"{_rate(p['colocated_max_rate'])}")
    else:
        t = co["ttft"]
        lines += [
            f"    TTFT            mean {_ms(t['mean_s'])}, P99 {_ms(t['p99_s'])} (queue wait mean "
            f"{_ms(co['queue']['wait_s'])})",
            f"    ITL             P50 {_ms(co['itl_p50_s'])}, P99 {_ms(co['itl_p99_s'])}: {co['mixed_step_fraction']:.2%} "
            f"of steps carry a prompt chunk (up to {_ms(co['chunk_step_s'])}), a decode step alone "
            f"{_ms(co['decode_step_s'])}",
            f"    load            prefill {co['prefill_busy']:.0%} of each instance's time; decode batch "
            f"{co['decode_batch']:.1f} per instance (KV room for {co['decode_batch_max']:.0f})",
            f"    throughput      {co['output_tokens_per_s']:.0f} output tok/s; keeps up to "
            f"{_rate(p['colocated_max_rate'])}"]
    return lines


def _disagg_lines(p: dict[str, Any]) -> list[str]:
    dis = p["disaggregated"]
    x, y, n = p["prefill_instances"], p["decode_instances"], p["prefill_instances"] + p["decode_instances"]
    lines = []
    pre, dec = dis["prefill"], dis["decode"]
    lines.append(f"  {p['xpyd']:<17} {x} prefill + {y} decode instances"
                 + (f", 1/{n} of the cores each" if p["hardware"] == "local-cpu" else ""))
    pre_line = f"    prefill pool    {pre['busy']:.0%} busy ({_rate(pre['rate_per_instance'])} per instance), " \
               f"KV link {pre['link_busy']:.0%} busy"
    if "ttft" in dis:
        t = dis["ttft"]
        pre_line += f"; TTFT mean {_ms(t['mean_s'])}, P99 {_ms(t['p99_s'])} (with the KV transfer)"
    else:
        pre_line += "; SATURATED"
    lines.append(pre_line)
    if dec["saturated"]:
        lines.append(f"    decode pool     SATURATED: the decode batch outgrows the KV room "
                     f"({dec['decode_batch_max']:.0f} per instance)")
    else:
        itl = (f"ITL P50 = P99 = {_ms(dis['itl_p99_s'])} (no prefill in its steps)" if not dec["receiving"] else
               f"ITL P50 {_ms(dis['itl_p50_s'])}, P99 {_ms(dis['itl_p99_s'])} (no prefill in its steps; receiving KV "
               f"on its cores {dec['receiving']:.1%} of the time)")
        lines.append(f"    decode pool     {itl}; batch {dec['decode_batch']:.1f} per instance, {dec['busy']:.0%} of "
                     "its token capacity")
    lines.append("    throughput      " + (f"{dis['output_tokens_per_s']:.0f} output tok/s; " if not dis["saturated"]
                                          else "") + f"keeps up to {_rate(p['disaggregated_max_rate'])}")
    best = p.get("best_split")
    if best and best["xpyd"] != p["xpyd"]:
        lines.append(f"    best split      {best['xpyd']} of the same {n} instances keeps up to {_rate(best['max_rate'])}")
    return lines


def format_disagg(p: dict[str, Any]) -> str:
    dis, tr = p["disaggregated"], p["traffic"]
    n = p["prefill_instances"] + p["decode_instances"]
    mix = " + ".join(f"{share:.0%} of {tokens}" for share, tokens in p["classes"])
    what = (f"one machine, split {n} ways or not" if p["hardware"] == "local-cpu" else
            f"{n} instances of TP={p['tp']} = {p['devices']} devices")
    lines = [
        f"{p['model']} on {p['hardware']}, {p['xpyd']} vs colocated: {what}; weights {p['weight_dtype']}, "
        f"KV {p['kv_dtype']}, matmuls {p['compute_dtype']}",
        f"  traffic           {_rate(tr['rate'])} (Poisson); prompts {mix} tokens, {tr['output_len']} output tokens; "
        f"chunks of {p['chunk_tokens']} tokens",
    ]
    for share, tokens in p["classes"]:
        lines.append(f"  KV per request    {_gib(dis['kv_bytes_per_request'][tokens])} ({tokens} tokens x "
                     f"{p['kv_bytes_per_token'] / 1024:g} KiB); transfer {_ms(dis['kv_transfer_s'][tokens])} over "
                     f"{p['tp']} x {p['kv_link']} ({p['kv_link_bandwidth'] / 1e9:.3g} GB/s each)")
    lines += _colocated_lines(p) + _disagg_lines(p)
    be = p["break_even_rate"]
    lines.append("  break-even        " + (
        f"{p['xpyd']} pays from {_rate(be)} (up to {_rate(p['disaggregated_max_rate'])}, where it saturates)"
        if be is not None else f"{p['xpyd']} pays at no rate up to {_rate(p['disaggregated_max_rate'])}"))
    if tr.get("long_input_len"):
        bl = p["break_even_long_fraction"]
        lines.append("                    " + (
            f"at {_rate(tr['rate'])}: from {bl:.1%} of prompts at {tr['long_input_len']} tokens" if bl is not None
            else f"at {_rate(tr['rate'])}: at no share of {tr['long_input_len']}-token prompts"))
    lines.append(f"  verdict           {p['verdict']}")
    lines += [f"  assumes           {a}" for a in p["assumptions"]]
    lines += [f"  note: {n}" for n in p["notes"]]
    return "\n".join(lines)
