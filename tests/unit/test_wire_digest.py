"""Key digests: one keyed function shared by the sidecar (ledger, tiers) and engines (EVICT).

The key-digest key is derived from the pseudonym key and is not the pseudonym key; the digests
the sidecar records are exactly what an engine computes with the key it is given; an EVICT
request recognises only the keys it names; the key never shows in a repr; a HELLO reply carries
it as hex and a malformed one is refused.
"""

from __future__ import annotations

import hashlib
import hmac

import pytest

from kvgov.ledger.pseudonym import Pseudonymizer, derive_key_digest_key
from kvgov.wire.codec import WireError
from kvgov.wire.digest import KeyDigester, is_digest
from kvgov.wire.messages import EvictRequest, ServerInfo, evict_meta, parse_evict

PSEUDONYM_KEY = bytes(range(32))
KEY_A = "m@1@0@1f2c@bfloat16@tenant%acme@user%alice"
KEY_B = "m@1@0@9e9e@bfloat16@tenant%acme@user%bob"


def _reply(**extra: object) -> dict[str, object]:
    return {
        "server": "kvgov",
        "version": "0",
        "protocol": 1,
        "sidecar": "s",
        "max_frame_bytes": 1 << 20,
        "max_batch": 4096,
        "engine": "e",
        **extra,
    }


def test_sidecar_digests_are_what_an_engine_computes_with_the_key_it_is_given() -> None:
    p = Pseudonymizer(PSEUDONYM_KEY)
    wire_key = p.key_digester.to_hex()
    engine_side = KeyDigester.from_hex(wire_key)
    assert engine_side.digest(KEY_A) == p.key_digest(KEY_A)
    assert is_digest(p.key_digest(KEY_A))
    assert p.key_digest(KEY_A) != p.key_digest(KEY_B)


def test_the_key_digest_key_is_derived_and_is_not_the_pseudonym_key() -> None:
    derived = derive_key_digest_key(PSEUDONYM_KEY)
    assert derived == hmac.new(PSEUDONYM_KEY, b"kvgov/key-digest/v1", hashlib.sha256).digest()
    assert derived != PSEUDONYM_KEY
    p = Pseudonymizer(PSEUDONYM_KEY)
    assert bytes.fromhex(p.key_digester.to_hex()) == derived
    # digests use the derived key, not the pseudonym key
    plain = hmac.new(PSEUDONYM_KEY, b"kvgov/cache-key/v1\x00" + KEY_A.encode(), hashlib.sha256)
    assert p.key_digest(KEY_A) != plain.hexdigest()
    # another pseudonym key, another digest key
    assert Pseudonymizer(bytes(32)).key_digest(KEY_A) != p.key_digest(KEY_A)


def test_the_key_never_shows_in_a_repr() -> None:
    p = Pseudonymizer(PSEUDONYM_KEY)
    hexkey = p.key_digester.to_hex()
    info = ServerInfo.from_reply(_reply(key_digest_key=hexkey))
    request = EvictRequest(frozenset(), p.key_digester)
    for text in (repr(p), repr(p.key_digester), repr(info), repr(request)):
        assert hexkey not in text
        assert hexkey[:16] not in text


def test_hello_reply_carries_the_digester_only_when_given() -> None:
    p = Pseudonymizer(PSEUDONYM_KEY)
    assert ServerInfo.from_reply(_reply()).digester is None
    info = ServerInfo.from_reply(_reply(key_digest_key=p.key_digester.to_hex()))
    assert info.digester is not None
    assert info.digester.digest(KEY_A) == p.key_digest(KEY_A)
    for bad in ("zz", "00" * 8, "00" * 33):
        with pytest.raises(WireError, match="malformed HELLO reply"):
            ServerInfo.from_reply(_reply(key_digest_key=bad))


def test_an_evict_request_matches_only_the_keys_it_names() -> None:
    p = Pseudonymizer(PSEUDONYM_KEY)

    class LmKey:  # like LMCache's CacheEngineKey: its string form is to_string()
        def __init__(self, text: str) -> None:
            self.text = text

        def to_string(self) -> str:
            return self.text

    lm_a, lm_b = LmKey(KEY_A), LmKey(KEY_B)
    request = EvictRequest(frozenset({p.key_digest(KEY_A), "f" * 64}), p.key_digester)
    assert request.matching([KEY_A, KEY_B]) == [(KEY_A, p.key_digest(KEY_A))]
    assert request.matching([lm_b, lm_a]) == [(lm_a, p.key_digest(KEY_A))]
    assert EvictRequest(frozenset({"0" * 64}), p.key_digester).matching([KEY_A, KEY_B]) == []


def test_evict_metadata_carries_digests_and_drops_anything_else() -> None:
    p = Pseudonymizer(PSEUDONYM_KEY)
    d = p.key_digest(KEY_A)
    meta = evict_meta([d], job="job-1")
    assert meta == {"digests": [d], "reason": "purge", "job": "job-1"}
    assert parse_evict(meta) == [d]
    # raw keys, upper case, wrong length, non-strings: never passed to the engine's callback
    assert parse_evict({"digests": [KEY_A, d.upper(), d[:-1], 7, None, d]}) == [d]
    assert parse_evict({"keys": [KEY_A]}) == []
    assert parse_evict({"digests": "not a list"}) == []


@pytest.mark.parametrize("key_len", [16, 32, 64, 65, 200])
@pytest.mark.parametrize("cache_key", ["", KEY_A, "m@1@0@ff@bfloat16@tenant%t@user%ü" * 5])
def test_digest_is_rfc2104_hmac_sha256_of_the_domain_and_key(key_len: int, cache_key: str) -> None:
    """The precomputed inner/outer states give exactly the standard library's HMAC, for keys
    shorter than, equal to and longer than SHA-256's block (hashed first, as RFC 2104 says)."""
    key = bytes((7 * i + key_len) % 256 for i in range(key_len))
    expected = hmac.new(key, b"kvgov/cache-key/v1\x00" + cache_key.encode(), hashlib.sha256)
    digester = KeyDigester(key)
    assert digester.digest(cache_key) == expected.hexdigest()
    assert digester.digest(cache_key) == expected.hexdigest()  # the keyed states stay unchanged
