"""HELLO with an engine token, proven both ways without sending it (``docs/protocol.md``,
"Authentication").

The engine never sends its token. It names which token it holds (:func:`token_id`, a keyed
hash that reveals nothing of the token) and a fresh nonce; the sidecar answers with its own
nonce and a proof that it holds the same token (:func:`proof`, side ``server``); only once that
proof checks out does the engine send its own (side ``client``) and, after the sidecar admits
it, any request. A process that took the sidecar's port or socket path (while the sidecar
restarted, say) learns neither the token nor a single KV byte: it cannot answer the challenge,
and the engine stops there.

Both proofs are HMAC-SHA256 under the token over one transcript: the protocol version, the
side, the role, the engine id the client claimed, the token id and both nonces. The server's
proof cannot be replayed as the client's (the side differs), nor one connection's on another
(the nonces differ).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from kvgov.wire.codec import PROTOCOL_VERSION

#: hex digits of a nonce (32 random bytes)
NONCE_HEX = 64
#: hex digits of a token id
TOKEN_ID_HEX = 32
_ID_LABEL = b"kvgov token id\x00"


def token_id(token: str) -> str:
    """Which token a client holds, without revealing it: a hash of the token (engine tokens
    are long random strings; nothing of one can be learnt from its id)."""
    return hashlib.sha256(_ID_LABEL + token.encode()).hexdigest()[:TOKEN_ID_HEX]


def new_nonce() -> str:
    return secrets.token_hex(NONCE_HEX // 2)


def is_nonce(value: object) -> bool:
    """A well-formed nonce: ``NONCE_HEX`` lowercase hex digits."""
    return (
        isinstance(value, str)
        and len(value) == NONCE_HEX
        and all(c in "0123456789abcdef" for c in value)
    )


def proof(
    token: str,
    side: str,
    *,
    role: str,
    engine: str,
    tid: str,
    client_nonce: str,
    server_nonce: str,
) -> str:
    """What ``side`` (``server`` or ``client``) sends to show it holds ``token``."""
    transcript = "\x00".join(
        (
            f"kvgov-hello/{PROTOCOL_VERSION}",
            side,
            role,
            engine,
            tid,
            client_nonce,
            server_nonce,
        )
    )
    return hmac.new(token.encode(), transcript.encode(), hashlib.sha256).hexdigest()


def proven(expected: str, presented: object) -> bool:
    """``presented`` is the expected proof (compared in constant time)."""
    return isinstance(presented, str) and hmac.compare_digest(
        expected.encode(), presented.encode("utf-8", "surrogatepass")
    )


def start(
    token: str, meta: Mapping[str, Any]
) -> tuple[dict[str, Any], Callable[[Mapping[str, Any]], dict[str, Any] | None]]:
    """An engine's side of the handshake: the first HELLO's metadata (``meta`` naming the
    token), and what answers the sidecar's challenge: the second HELLO's metadata, or None when
    the challenge does not prove the sidecar holds ``token`` (send nothing more then)."""
    tid, client_nonce = token_id(token), new_nonce()

    def answer(challenge: Mapping[str, Any]) -> dict[str, Any] | None:
        server_nonce = challenge.get("nonce")
        if not is_nonce(server_nonce):
            return None
        bound = {
            "role": str(meta.get("role", "")),
            "engine": str(meta.get("engine", "")),
            "tid": tid,
            "client_nonce": client_nonce,
            "server_nonce": str(server_nonce),
        }
        if not proven(proof(token, "server", **bound), challenge.get("proof")):
            return None
        return {"proof": proof(token, "client", **bound)}

    return {**meta, "token_id": tid, "nonce": client_nonce}, answer
