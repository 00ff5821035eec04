"""uvicorn in a background thread: a training run's in-process server, and tests' servers.

Design decision: the server gets its own thread and event loop, so agent code running on the
driver's loop (user code that may block) can never stall request handling, and the socket is
bound before the thread starts — port 0 picks a free port with no race, and the URL is known
when ``start`` returns. The socket is made with ``IPPROTO_TCP`` explicitly: asyncio turns Nagle's
algorithm off (``TCP_NODELAY``) only on sockets whose protocol says TCP, and with it on, a
response's body (written after its headers) waited for the client's delayed ACK — 40 ms per
call on Linux whenever the client had nothing to send back.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from groupflow.serve.access import LOCAL_HOSTS

__all__ = ["ServerThread", "check_bind"]


def check_bind(host: str, api_key: str | None) -> None:
    """Any address but the loopback needs an API key (never an open server on a network)."""
    if host not in LOCAL_HOSTS and not api_key:
        raise ValueError(
            f"--host {host}: serving on an address other than 127.0.0.1 needs an API key "
            "(--api-key KEY or the GROUPFLOW_API_KEY environment variable)"
        )


class ServerThread:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        # keep-alive far beyond uvicorn's 5 s: a pooled connection closed between two training
        # steps would fail the next episode's first call
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                timeout_keep_alive=3600)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
            name="groupflow-server",
        )  # fmt: skip

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the rollout server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()
