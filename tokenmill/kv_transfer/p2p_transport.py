"""Moving KV blocks between instances: the transport interface and its TCP implementation.

A transport moves a request's blocks, named by (remote request id, block ids), as raw byte rows (one row per
block: every layer's K and V as the KV cache stores them, so fp8/int8 caches move their narrow bytes). An
8-bit cache's bytes mean value / scale, so a pull also carries the serving side's per-layer K/V scales (a few
floats per layer; int8 ones are calibrated per instance). Each block, and the scales, travel with a CRC-32 that
the puller checks; a pull ends with a "done" note that lets the serving side
free the blocks, sent whatever happened (success, corruption, refusal, cancellation). An RDMA/NVLink transport
(NIXL) can implement the same interface, reading straight from the remote device memory.

TCP framing: every message is a 4-byte length, a msgpack header, then `nbytes` of payload if the header says
so. Every socket operation has a timeout, so a dead peer ends a pull with TransferError, never a hang.
"""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import msgspec
import numpy as np

logger = logging.getLogger("tokenmill")
_LEN = struct.Struct("!I")
_IO_TIMEOUT_S = 10.0


class TransferError(Exception):
    """A pull failed (peer gone, refused, corrupt, timed out, cancelled); the puller recomputes."""


class NotReady(Exception):
    """The serving side does not offer this request's blocks (yet): the puller may ask again."""


@dataclass
class Blocks:
    """What a pull moves: the blocks' byte rows [n, block bytes] and, for an 8-bit KV cache, the K/V scales
    those bytes were quantized with (fp32, each layer's [2, KV heads] in layer order, flattened); else None."""
    rows: np.ndarray
    scales: Optional[np.ndarray] = None


class BlockSource(Protocol):
    """What a transport serves from (the prefill worker)."""
    def read_blocks(self, request_id: str, block_ids: list[int], kv_fingerprint: str) -> Blocks:
        """The offered blocks (and scales); raises NotReady, or TransferError with the reason."""

    def done(self, request_id: str) -> None:
        """The puller is done with request_id's blocks."""


class BlockTransport(ABC):
    @abstractmethod
    def serve(self, source: BlockSource, host: str, port: int) -> int:
        """Serve block reads from source in the background; returns the bound port."""

    @abstractmethod
    def pull(self, host: str, port: int, request_id: str, block_ids: list[int], kv_fingerprint: str,
             deadline: float, cancelled: Callable[[], bool]) -> Blocks:
        """The blocks (rows and scales), each checked against its CRC; then tells the server it is done (also
        when failing). Raises TransferError. With no block_ids it only says done."""

    def close(self) -> None:
        pass


class TcpTransport(BlockTransport):
    # Test hooks: the server flips one byte in this many of the next blocks / scale frames it sends (after
    # their checksum).
    corrupt_next_blocks = 0
    corrupt_next_scales = 0

    def __init__(self) -> None:
        self._listener: Optional[socket.socket] = None
        self._closed = threading.Event()

    # -- serving side -------------------------------------------------------------------------
    def serve(self, source: BlockSource, host: str, port: int) -> int:
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.settimeout(0.5)  # so the accept loop notices close()
        threading.Thread(target=self._accept_loop, args=(source,), name="kv-transfer-server", daemon=True).start()
        return self._listener.getsockname()[1]

    def _accept_loop(self, source: BlockSource) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve_conn, args=(conn, source), daemon=True).start()

    def _serve_conn(self, conn: socket.socket, source: BlockSource) -> None:
        conn.settimeout(_IO_TIMEOUT_S)
        with conn:
            try:
                while not self._closed.is_set():
                    msg, _ = _recv(conn)
                    if msg["op"] == "done":
                        source.done(msg["rid"])
                        _send(conn, {"status": "ok"})
                    else:
                        self._serve_pull(conn, source, msg)
            except (OSError, ConnectionError, ValueError, KeyError):
                return  # the puller went away (or spoke nonsense): it will recompute

    def _serve_pull(self, conn: socket.socket, source: BlockSource, msg: dict) -> None:
        try:
            blocks = source.read_blocks(msg["rid"], msg["blocks"], msg["fp"])
        except NotReady:
            _send(conn, {"status": "not_ready"})
            return
        except TransferError as e:
            _send(conn, {"status": "error", "error": str(e)})
            return
        rows, scales = blocks.rows, blocks.scales
        _send(conn, {"status": "ok", "n": len(rows), "row_bytes": rows.shape[1],
                     "num_scales": 0 if scales is None else scales.size})
        if scales is not None:
            _send_checked(conn, scales.view(np.uint8), "corrupt_next_scales")
        for row in rows:
            _send_checked(conn, row, "corrupt_next_blocks")

    # -- pulling side -------------------------------------------------------------------------
    def pull(self, host: str, port: int, request_id: str, block_ids: list[int], kv_fingerprint: str,
             deadline: float, cancelled: Callable[[], bool]) -> Blocks:
        try:
            with socket.create_connection((host, port), timeout=_IO_TIMEOUT_S) as conn:
                try:
                    return self._pull_rows(conn, request_id, block_ids, kv_fingerprint, deadline, cancelled)
                finally:  # whatever happened, the serving side may free the blocks now (best effort: it
                    _say_done(conn, request_id)  # frees them after its hold timeout anyway)
        except (OSError, ConnectionError, ValueError) as e:
            raise TransferError(f"KV pull from {host}:{port} failed: {type(e).__name__}: {e}") from None

    def _pull_rows(self, conn: socket.socket, request_id: str, block_ids: list[int], kv_fingerprint: str,
                   deadline: float, cancelled: Callable[[], bool]) -> Blocks:
        if not block_ids:
            return Blocks(np.empty((0, 0), dtype=np.uint8))
        while True:
            if cancelled():
                raise TransferError("cancelled")
            if time.monotonic() > deadline:
                raise TransferError(f"timed out waiting for request {request_id!r}'s blocks")
            _send(conn, {"op": "pull", "rid": request_id, "blocks": block_ids, "fp": kv_fingerprint})
            head, _ = _recv(conn)
            if head["status"] == "ok":
                break
            if head["status"] == "error":
                raise TransferError(head["error"])
            time.sleep(0.005)  # not offered yet: the prefill step that writes them is finishing
        # Every frame is read even after a bad one, so the stream stays in step for the "done" note.
        scales = np.empty(head.get("num_scales", 0), dtype=np.float32) if head.get("num_scales") else None
        bad = ["scales"] if scales is not None and not _recv_checked(conn, scales.view(np.uint8)) else []
        rows = np.empty((head["n"], head["row_bytes"]), dtype=np.uint8)
        bad += [f"block {block_ids[i]}" for i in range(head["n"]) if not _recv_checked(conn, rows[i])]
        if bad:
            raise TransferError(f"{', '.join(bad)} of request {request_id!r} arrived corrupt (CRC mismatch)")
        if cancelled() or time.monotonic() > deadline:
            raise TransferError("cancelled" if cancelled() else "timed out")
        return Blocks(rows, scales)

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()


def _say_done(conn: socket.socket, request_id: str) -> None:
    try:
        _send(conn, {"op": "done", "rid": request_id})
        _recv(conn)
    except (OSError, ConnectionError, ValueError) as e:
        logger.debug("KV transfer: could not say done for %s: %s", request_id, e)


def _send_checked(conn: socket.socket, data: np.ndarray, corrupt_hook: str) -> None:
    """One frame of bytes with its CRC-32 (the named test hook may flip a byte after the checksum)."""
    crc = zlib.crc32(data)
    if getattr(TcpTransport, corrupt_hook) > 0:
        setattr(TcpTransport, corrupt_hook, getattr(TcpTransport, corrupt_hook) - 1)
        data = data.copy()
        data[len(data) // 2] ^= 0xFF
    _send(conn, {"crc": crc}, data)


def _recv_checked(conn: socket.socket, into: np.ndarray) -> bool:
    """Receive a _send_checked frame into `into`; whether it matches its CRC."""
    return _recv(conn, into=into)[0]["crc"] == zlib.crc32(into)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(dict)


def _send(conn: socket.socket, head: dict, payload: Optional[np.ndarray] = None) -> None:
    if payload is not None:
        head = {**head, "nbytes": payload.nbytes}
    data = _encoder.encode(head)
    conn.sendall(_LEN.pack(len(data)) + data)
    if payload is not None:
        conn.sendall(memoryview(np.ascontiguousarray(payload)).cast("B"))


def _recv(conn: socket.socket, into: Optional[np.ndarray] = None) -> tuple[dict, Optional[memoryview]]:
    """One message; its payload goes into `into` (which must have exactly its size) when given."""
    (n,) = _LEN.unpack(_recv_exact(conn, memoryview(bytearray(_LEN.size))))
    head = _decoder.decode(_recv_exact(conn, memoryview(bytearray(n))))
    nbytes = head.get("nbytes", 0)
    if not nbytes:
        return head, None
    if into is None or into.nbytes != nbytes:
        raise ValueError(f"unexpected payload of {nbytes} bytes")
    return head, _recv_exact(conn, memoryview(into).cast("B"))


def _recv_exact(conn: socket.socket, buf: memoryview) -> memoryview:
    got = 0
    while got < len(buf):
        n = conn.recv_into(buf[got:])
        if n == 0:
            raise ConnectionError("connection closed by peer")
        got += n
    return buf
