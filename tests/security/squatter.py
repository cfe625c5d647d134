"""What vLLM's code would run where kvgov looks for OPA once OPA's listener is gone: an HTTP
server that answers every request carrying a token ``allowed: true`` (and one without a token
401, as the locked OPA does, so kvgov's start-up probe takes it for OPA), recording the
Authorization headers it was sent. Shared by the OPA channel's attack tests."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvgov.policy.interfaces import PolicyInput

#: a decision the shipped policy always denies (a class never cacheable, another tenant)
FORBIDDEN = PolicyInput(
    operation="get",
    tenant="globex",
    engine="vllm",
    key_tenant="globex",
    actor_user="u1",
    sensitivity="restricted",
)

ALLOW_ALL: dict[str, Any] = {"result": {"allowed": True, "reasons": [], "tiers": []}}


class _Server(ThreadingHTTPServer):
    allow_reuse_address = True


@contextmanager
def squatter(port: int = 0, *, tokenless: int = 401) -> Iterator[tuple[int, list[str]]]:
    """A squatter on 127.0.0.1:``port`` (0: any free port); yields its port and the
    Authorization headers it saw. ``tokenless``: the status it answers a request with none
    (200: it allows those too). Raises OSError when the port cannot be bound."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            auth = self.headers.get("Authorization", "")
            seen.append(auth)
            status = 200 if auth else tokenless
            body = ALLOW_ALL if status == 200 else {"code": "unauthorized"}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    with serving(_Server(("127.0.0.1", port), Handler)) as bound:
        yield bound, seen


@contextmanager
def serving(httpd: ThreadingHTTPServer) -> Iterator[int]:
    """``httpd`` serving in a thread while the block runs; yields its port."""
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(httpd.server_address[1])
    finally:
        httpd.shutdown()
        httpd.server_close()
