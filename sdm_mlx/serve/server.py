"""Running the app: a pre-bound loopback socket and uvicorn with a clean exit on Ctrl-C / SIGTERM."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading

import uvicorn

#: open connections beyond which new requests get 503 (bounds memory under a flood of clients)
MAX_CONNECTIONS = 256
#: idle keep-alive connections are closed after this many seconds
KEEP_ALIVE_SECONDS = 5
#: largest request head (request line + headers) accepted
MAX_HEADER_BYTES = 64 * 1024


class Server(uvicorn.Server):
    """uvicorn's server without re-raising the caught signal after a graceful shutdown.

    uvicorn re-raises SIGINT/SIGTERM once it has shut down (so the process dies of
    the signal); here a signal only requests the graceful shutdown, and ``run``
    returns normally so the command exits 0 after closing the engine.
    ``on_exit()`` runs at the first signal (the engine aborts running generations,
    so open streams end at once with a "shutting down" error event).
    """

    def __init__(self, config, on_exit=None):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        if self._on_exit is not None:
            self._on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port); OSError if it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(app, sock: socket.socket, *, access_log: bool = True, log_level: str = "info",
          graceful_timeout: float = 5.0, on_exit=None) -> None:
    """Serve ``app`` on the bound ``sock`` until SIGINT / SIGTERM; returns after a graceful shutdown."""
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="off",
                            timeout_graceful_shutdown=graceful_timeout, limit_concurrency=MAX_CONNECTIONS,
                            timeout_keep_alive=KEEP_ALIVE_SECONDS, h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    Server(config, on_exit=on_exit).run(sockets=[sock])
