"""Prefix caching and KV tiers: time to first token for a long shared prefix + a short new suffix.

On the default model (SmolLM2-135M-Instruct), a 4096-token document (Python's own docs) followed by a 32-token
question, one request at a time:
- recompute: prefix caching off, the whole prompt is prefilled (the baseline);
- device hit: the prefix is still in the device KV cache;
- host restore: the prefix was evicted from the device pool to the host-RAM tier and is copied back;
- disk restore: it was pushed further down to the disk tier and is read back (checksummed) through host RAM.
Filler documents as long as the device cache do the evicting. Every restore's first 8 tokens are compared with
the recompute of the same prompt. Prints a JSON result and one summary line.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from tokenmill import LLM, SamplingParams
from tokenmill.messages import EngineCoreRequest

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BLOCK_SIZE = 16


def document_tokens(tokenizer, n: int) -> list[int]:
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < n:
        raise RuntimeError(f"the document has only {len(ids)} tokens, {n} are needed")
    return ids[:n]


def ttft(llm: LLM, prompt: list[int], rid: str) -> tuple[float, list[int], int]:
    """(seconds to the first token, the first 8 tokens, cached prompt tokens), driving the engine directly."""
    eng = llm.engine
    t0 = time.perf_counter()
    eng.add_request(EngineCoreRequest(rid, prompt, GREEDY))
    first, tokens, cached = None, [], 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
            if first is None and tokens:
                first = time.perf_counter() - t0
    return first, tokens, cached


def _where(llm: LLM) -> dict[str, int]:
    """Cumulative cached prompt tokens by tier, and disk blocks that failed their checks."""
    stats, connector = llm.engine.stats(), llm.engine.scheduler.connector
    out = {"device_tokens": stats.prefix_cache_hits}
    if connector is not None:
        c = connector.counters()
        out.update(host_tokens=BLOCK_SIZE * (c.get("host_hit_blocks", 0) - c.get("disk_hit_blocks", 0)),
                   disk_tokens=BLOCK_SIZE * c.get("disk_hit_blocks", 0), failed_disk_blocks=c.get("failed_blocks", 0))
    return out


def main() -> None:
    os.environ.setdefault("TOKENMILL_REQUIRE_KERNELS", "1")  # no figure from a slow path (kernels_report.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2,
                    help="recompute and device-hit measurements (the fastest counts: other load only adds time)")
    args = ap.parse_args()
    P, S = args.prefix_tokens, args.suffix_tokens
    blocks_per_request = -(-(P + S + GREEDY.max_tokens) // BLOCK_SIZE)
    device_blocks = blocks_per_request + 8  # room for one long request: the next one evicts it
    host_blocks = blocks_per_request + 8    # the prefix, or one filler: the second filler pushes it to disk

    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-") as disk_dir:
        off = LLM(None, block_size=BLOCK_SIZE, num_gpu_blocks_override=device_blocks, enable_prefix_caching=False)
        bpb = off.engine.executor.bytes_per_block()
        on = LLM(None, block_size=BLOCK_SIZE, num_gpu_blocks_override=device_blocks,
                 kv_offloading_size=f"{host_blocks * bpb}B",
                 kv_offloading_disk_dir=disk_dir)
        F = device_blocks * BLOCK_SIZE - GREEDY.max_tokens  # a filler takes every device block
        doc = document_tokens(on.get_tokenizer(), P + 3 * F + 8 * S)
        prefix = doc[:P]
        fillers = [doc[P + i * F:P + (i + 1) * F] for i in range(3)]
        suffixes = [doc[P + 3 * F + i * S:P + 3 * F + (i + 1) * S] for i in range(8)]
        counter = iter(range(10**6))

        def run(llm, prompt):
            """ttft() plus where the prompt's cached tokens came from."""
            before = _where(llm)
            t, tokens, cached = ttft(llm, prompt, f"r{next(counter)}")
            return t, tokens, cached, {k: v - before.get(k, 0) for k, v in _where(llm).items()}

        run(off, suffixes[0])  # warm-up (first-call costs)
        run(on, suffixes[0])
        recompute = [run(off, prefix + suffixes[1 + i % 2]) for i in range(max(args.repeats, 2))]
        reference = {1: recompute[0][1], 2: recompute[1][1]}   # the 8 tokens of prefix + suffix 1, 2
        cold = run(on, prefix + suffixes[3])                    # fills the device cache
        device = [run(on, prefix + suffixes[4 + i % 2]) for i in range(args.repeats)]
        run(on, fillers[0])                                     # the prefix leaves the device: host tier
        host = run(on, prefix + suffixes[1])
        for f in fillers[1:]:                                   # ... and then the host tier: disk
            run(on, f)
        on.engine.executor.collective_rpc(lambda w: w.kv_connector.disk.flush())
        disk = run(on, prefix + suffixes[2])

    t_re = min(r[0] for r in recompute)
    t_dev = min(r[0] for r in device)
    result = {
        "model": on.config.model.served_model_name, "dtype": str(on.config.model.torch_dtype),
        "prefix_tokens": P, "suffix_tokens": S, "kv_bytes_per_block": bpb, "device_blocks": device_blocks,
        "host_tier_blocks": host_blocks,
        "ttft_s": {"recompute": t_re, "cold_cache_on": cold[0], "device_hit": t_dev, "host_restore": host[0],
                   "disk_restore": disk[0]},
        "ttft_runs_s": {"recompute": [r[0] for r in recompute], "device_hit": [r[0] for r in device]},
        "speedup_vs_recompute": {"device_hit": t_re / t_dev, "host_restore": t_re / host[0],
                                 "disk_restore": t_re / disk[0]},
        "cached_tokens": {"device_hit": device[0][2], "host_restore": host[2], "disk_restore": disk[2]},
        "cached_from": {"device_hit": device[0][3], "host_restore": host[3], "disk_restore": disk[3]},
        "outputs_match_recompute": {"host_restore": host[1] == reference[1], "disk_restore": disk[1] == reference[2]},
    }
    print(json.dumps(result, indent=2))
    sp = result["speedup_vs_recompute"]
    print(f"prefix_cache: TTFT for {P}+{S} tokens: recompute {t_re:.2f}s, device hit {t_dev * 1e3:.0f}ms "
          f"({sp['device_hit']:.0f}x), host restore {host[0] * 1e3:.0f}ms ({sp['host_restore']:.0f}x), "
          f"disk restore {disk[0] * 1e3:.0f}ms ({sp['disk_restore']:.0f}x); outputs identical: "
          f"{all(result['outputs_match_recompute'].values())}")


if __name__ == "__main__":
    main()
