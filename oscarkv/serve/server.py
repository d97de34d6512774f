"""Running the app under uvicorn: in the foreground (``oscarkv serve``: SIGINT/SIGTERM shut down gracefully) or
in a background thread (tests, benchmarks, notebooks)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..engine import LLM
from .app import ServeConfig, build_app


class _HeadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for a request's line and headers: a connection that has not sent a
    complete request head within ``timeout_keep_alive`` seconds of opening (or of its previous response) is
    closed, however slowly it trickles bytes. (Upstream only times out idle keep-alive connections, and any byte
    resets that timer.)"""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        # The timer is cancelled when a whole request head has been parsed (in handle_events), not on any data.
        self.conn.receive_data(data)
        self.handle_events()


class Server:
    """``llm`` served over HTTP on ``host:port`` (port 0: a free port, see :attr:`port`).

    Args:
        max_connections: open connections (and requests) beyond this are answered 503 at once.
        head_timeout_s: seconds a connection may take to send a request's headers (and may stay idle between
            requests).
        graceful_timeout_s: on shutdown, seconds in-flight requests get to finish before they are cancelled.
    """

    def __init__(self, llm: LLM, host: str = "127.0.0.1", port: int = 8000, config: ServeConfig | None = None, *,
                 max_connections: int = 512, head_timeout_s: float = 10.0, graceful_timeout_s: float = 30.0,
                 log_level: str = "warning"):
        self.app = build_app(llm, config or ServeConfig())
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=2048)
        self.host, self.port = host, self.socket.getsockname()[1]
        cfg = uvicorn.Config(self.app, http=_HeadTimeoutH11, lifespan="on", log_level=log_level, access_log=False,
                             limit_concurrency=max_connections, timeout_keep_alive=head_timeout_s,
                             timeout_graceful_shutdown=graceful_timeout_s)
        self.uvicorn = uvicorn.Server(cfg)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def loop(self):
        return self.app.state.loop

    def run(self) -> None:
        """Serve until SIGINT/SIGTERM (in the main thread) or :meth:`shutdown`; then finish in-flight requests
        (up to ``graceful_timeout_s``) and stop the engine loop."""
        self.uvicorn.run(sockets=[self.socket])

    def start(self, timeout: float = 60.0) -> Server:
        """Serve from a background thread; returns once the server accepts requests."""
        self._thread = threading.Thread(target=self.run, name="oscarkv-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start (see the log above)")
            time.sleep(0.01)
        return self

    def shutdown(self, timeout: float = 60.0) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.socket.close()


__all__ = ["Server"]
