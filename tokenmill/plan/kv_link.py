"""The KV link between two instances on this machine, measured now (`tokenmill plan --disaggregate` on local-cpu).

Two tokenmill instances on one machine move a prompt's KV with the engine's own path: the prefill side gathers
the blocks out of its KV tensors into host rows (kv_transfer/host_pool.py), the TCP transport frames them with
a CRC-32 each and sends them over loopback (kv_transfer/p2p_transport.py), and the decode side copies the rows
into its KV tensors. That path runs at a few hundred MB/s on a small CPU, far below a nominal loopback or
memory-copy rate, so the plan times it: the same three steps on KV tensors shaped like the model's (its layers,
one token's K or V bytes per layer), between two threads of this process, with torch at one instance's share
of the threads (`--disaggregate` splits them; more threads than cores on a busy machine make the copies spin).
Bandwidth is the slope between a one-block and a many-block pull; latency the one-block pull less its bytes.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from tokenmill.kv_transfer.host_pool import HostBlockPool
from tokenmill.kv_transfer.p2p_transport import Blocks, TcpTransport
from tokenmill.perf.hardware import Interconnect
from tokenmill.perf.memory import ModelShape

PROBE_BYTES = 16 * 2**20


class _KVSource:
    """Serves every block of `pool`'s KV tensors (the prefill side's read_blocks, without the bookkeeping)."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def read_blocks(self, request_id: str, block_ids: list[int], kv_fingerprint: str):
        return Blocks(self.pool.copy_out(block_ids))

    def done(self, request_id: str) -> None:
        pass


def measure_kv_loopback(shape: ModelShape, kv_dtype: str, threads: int = 1, block_size: int = 16,
                        probe_bytes: int = PROBE_BYTES, reps: int = 3) -> Interconnect:
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        return _probe(shape, kv_dtype, block_size, probe_bytes, reps)
    finally:
        torch.set_num_threads(before)


def _probe(shape: ModelShape, kv_dtype: str, block_size: int, probe_bytes: int, reps: int) -> Interconnect:
    layers = max(1, shape.num_layers)
    per_layer = max(1, shape.kv_bytes_per_token(kv_dtype) // (2 * layers))   # one token's K (or V) in a layer
    block_bytes = 2 * layers * per_layer * block_size
    n = int(min(256, max(4, probe_bytes // block_bytes)))
    src = [torch.zeros(2, 1, n, block_size, per_layer, dtype=torch.uint8) for _ in range(layers)]
    dst = HostBlockPool([torch.zeros_like(t) for t in src], 0)
    server, client = TcpTransport(), TcpTransport()
    port = server.serve(_KVSource(HostBlockPool(src, 0)), "127.0.0.1", 0)

    def pull(ids: list[int]) -> float:
        t = time.perf_counter()
        blocks = client.pull("127.0.0.1", port, "probe", ids, "", time.monotonic() + 60, lambda: False)
        dst.load_rows(torch.from_numpy(np.ascontiguousarray(blocks.rows)), ids)
        return time.perf_counter() - t

    try:
        one = min(pull([0]) for _ in range(reps))
        many = min(pull(list(range(n))) for _ in range(reps))
    finally:
        server.close()
    bandwidth = (n - 1) * block_bytes / max(many - one, 1e-9)
    latency = max(0.0, one - block_bytes / bandwidth)
    return Interconnect("loopback-TCP", bandwidth, latency, "node",
                        f"measured now: tokenmill's KV transfer path between two threads of this machine "
                        f"({n} blocks of {block_bytes / 2**20:.2f} MiB)")
