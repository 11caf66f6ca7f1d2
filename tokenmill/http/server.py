"""Serving an app: the listening socket (bound before anything slow, so a busy port fails fast) and a uvicorn
server that drains on SIGINT/SIGTERM and then returns, for `tokenmill serve` and `tokenmill router`."""
from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading

logger = logging.getLogger("tokenmill")


class DrainingServer:
    """uvicorn.Server whose signal handling drains and then returns (uvicorn re-raises the signal after
    a graceful shutdown, which would make the exit status -SIGTERM instead of 0). `on_signal` runs on the
    loop as the drain begins: streams that never end by themselves (the dashboard's) end there, or uvicorn
    would wait the whole graceful period for them. `on_deadline` runs a second before the graceful period
    ends, so open streams can still end with an error event and [DONE] instead of being cut. `stop_when` is
    asked every tick (0.1 s): True stops the server as a signal would, without the drain callbacks."""

    @staticmethod
    def make(config, on_deadline=None, on_signal=None, stop_when=None):
        import asyncio

        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for s, h in old.items():
                        signal.signal(s, h)

            def handle_exit(self, sig, frame) -> None:
                if not self.should_exit:
                    timeout = self.config.timeout_graceful_shutdown
                    logger.info("received %s: draining in-flight requests (up to %.0fs)",
                                signal.Signals(sig).name, timeout)
                    loop = asyncio.get_event_loop()
                    if on_signal is not None:
                        loop.call_soon_threadsafe(on_signal)
                    if on_deadline is not None and timeout is not None:
                        loop.call_soon_threadsafe(loop.call_later, max(timeout - 1.0, 0.0), on_deadline)
                super().handle_exit(sig, frame)

            async def on_tick(self, counter: int) -> bool:
                if stop_when is not None and stop_when():
                    self.should_exit = True
                return await super().on_tick(counter)

        return Server(config)


def bind_listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(False)
    return sock
