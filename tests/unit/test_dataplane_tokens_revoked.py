"""The wire server once every engine token was revoked (review r16, finding 3): a server
that was given tokens and then an empty map admits nobody. It must not fall back to what a
server never given a token does (admit a Unix peer of the sidecar's uid, or anyone in
development, as whatever engine it names), and it closes every connection opened with a
token."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import SecretStr

from kvgov.proxy.dataplane.identity import Identity
from kvgov.proxy.dataplane.limits import ConnectionLimits
from kvgov.proxy.dataplane.server import ServerConfig, WireServer
from kvgov.proxy.dataplane.wireconn import Challenge
from kvgov.wire import handshake
from kvgov.wire.codec import PROTOCOL_VERSION, ErrorCode, WireError

TOKEN = "s3cret-t0ken-value"


def _server(tokens: dict[str, str]) -> WireServer:
    """A development server (anonymous admission on) with ``tokens`` at start."""
    config = ServerConfig(
        sidecar_id="test",
        version="0",
        max_frame_bytes=1 << 20,
        engine_tokens={t: SecretStr(e) for t, e in tokens.items()},
        allow_anonymous=True,
    )
    limits = ConnectionLimits(max_total=8, per_peer=8, per_engine=8)
    return WireServer(SimpleNamespace(), config, limits)  # type: ignore[arg-type]


#: a Unix peer of the sidecar's own uid (the peer-uid admission) and a TCP peer (anonymous)
PEERS = {
    "unix-own-uid": SimpleNamespace(unix=True, peer_uid=os.getuid()),
    "tcp": SimpleNamespace(unix=False, peer_uid=None),
}


class _Conn:
    def __init__(self, engine: str, token: str | None) -> None:
        self.identity = Identity(engine, f"engine:{engine}")
        self.token_id = handshake.token_id(token) if token is not None else None
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("peer", list(PEERS.values()), ids=list(PEERS))
def test_an_empty_token_map_after_tokens_admits_nobody(peer: Any) -> None:
    server = _server({TOKEN: "vllm-0"})
    server.replace_tokens({})
    assert server.tokens_configured
    for meta in (
        {"version": PROTOCOL_VERSION, "engine": "vllm-0"},
        {"version": PROTOCOL_VERSION, "engine": "vllm-0", "role": "control"},
        {
            "version": PROTOCOL_VERSION,
            "engine": "vllm-0",
            "token_id": "x",
            "nonce": handshake.new_nonce(),
        },
    ):
        with pytest.raises(WireError) as err:
            server.authenticate(meta, peer)
        assert err.value.error is ErrorCode.UNAUTHENTICATED
        assert "revoked" in err.value.message
    assert not server.token_current(handshake.token_id(TOKEN), "vllm-0")


def test_tokens_given_again_are_challenged() -> None:
    server = _server({TOKEN: "vllm-0"})
    server.replace_tokens({})
    server.replace_tokens({"n3w-t0ken": SecretStr("vllm-0")})
    meta = {
        "version": PROTOCOL_VERSION,
        "engine": "vllm-0",
        "token_id": handshake.token_id("n3w-t0ken"),
        "nonce": handshake.new_nonce(),
    }
    got = server.authenticate(meta, PEERS["unix-own-uid"])
    assert isinstance(got, Challenge) and got.engine == "vllm-0"


def test_emptying_the_map_closes_every_token_connection() -> None:
    server = _server({TOKEN: "vllm-0", "other-t0ken": "vllm-1"})
    conns = [_Conn("vllm-0", TOKEN), _Conn("vllm-1", "other-t0ken")]
    server.connections.update(conns)  # type: ignore[arg-type]
    assert server.replace_tokens({}) == 2
    assert all(c.closed for c in conns)


def test_a_server_never_given_tokens_keeps_its_local_admission() -> None:
    """Unchanged: with no tokens ever configured, an empty reload is no revocation."""
    server = _server({})
    server.replace_tokens({})
    assert not server.tokens_configured
    got = server.authenticate({"engine": "vllm-0"}, PEERS["unix-own-uid"])
    assert isinstance(got, Identity) and got.engine == "vllm-0"
