"""Review r9, F1: production's refusal of OPA on a loopback TCP port read the URL's host as
text; other spellings of the same loopback address (and the host's own name) passed it. Now
production asks OPA only on ``unix://`` or ``https://``, whatever the host: plain HTTP proves
nothing of who answers.

Attack (the one commit 4ddb177 closes for ``http://127.0.0.1:8181``): whenever OPA's process
is gone, any container of the pod (vLLM's too) binds OPA's loopback port first, receives
kvgov's bearer token with every decision and answers each ``allowed``. The guard says "a mesh
does not cover loopback: dataplane.cleartext_network_ok does not lift this", yet with
``cleartext_network_ok`` (a meshed production) ``http://0x7f.1:8181``,
``http://0x7f000001:8181`` and the host's own name (in a pod: the pod's name, its own IP in
the pod's one network namespace; and ``ip6-localhost``, which the kubelet's /etc/hosts maps to
::1) are taken for "beyond this host", and aiohttp connects them to 127.0.0.1 (getaddrinfo's
inet_aton reads the hex forms; aiohttp refuses only all-digit forms such as ``127.1``).

The squatter below stands in for vLLM's code on the loopback port. The token is a test
value, never printed: the assertion reports a count.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvgov.policy.bundle import load_bundle
from kvgov.policy.opa import OpaRestPolicyEngine
from tests.security import doors
from tests.security.doors import ProdDatabase
from tests.security.squatter import FORBIDDEN, squatter
from tests.security.test_production_guards import OPA_TOKEN, _with


@pytest.fixture
def squatter_port() -> Iterator[tuple[int, list[str]]]:
    """vLLM's code on 127.0.0.1:<port> while OPA is gone: allows whatever carries a token."""
    with squatter() as found:
        yield found


def _own_name_is_loopback() -> bool:
    try:
        infos = socket.getaddrinfo(socket.gethostname(), 80, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return any(info[4][0].startswith("127.") for info in infos)


@pytest.mark.postgres
@pytest.mark.parametrize("host", ["0x7f.1", "0x7f000001", "<hostname>"])
async def test_a_meshed_production_refuses_every_spelling_of_a_loopback_opa(
    tmp_path: Path,
    prod_db: ProdDatabase,
    squatter_port: tuple[int, list[str]],
    host: str,
) -> None:
    port, seen = squatter_port
    if host == "<hostname>":
        if not _own_name_is_loopback():
            pytest.skip("this host's name does not resolve to loopback here")
        host = socket.gethostname()
    url = f"http://{host}:{port}"
    base = doors.settings(tmp_path, prod_db)
    try:
        settings = _with(
            base,
            policy={"engine": "opa", "opa_token": OPA_TOKEN, "opa_url": url},
            dataplane={"cleartext_network_ok": True},
        )
    except ValidationError as exc:
        assert "asks OPA over" in str(exc) and "policy.opa_url=http://" in str(exc)
        return  # refused, as http://127.0.0.1 is: production asks OPA on unix:// or https://
    # accepted: kvgov asks "OPA" there, and the squatter on 127.0.0.1 answers
    engine = OpaRestPolicyEngine(
        load_bundle(), url=settings.policy.opa_url, timeout_s=5.0, token=settings.opa_token
    )
    try:
        decision = await engine.decide(FORBIDDEN)
    finally:
        await engine.aclose()
    got_token = sum(1 for h in seen if h == f"Bearer {OPA_TOKEN}")
    assert got_token == 0 and not decision.allowed, (
        f"production accepted policy.opa_url={url!r} (cleartext_network_ok): a listener on"
        f" 127.0.0.1 got the bearer token {got_token} time(s) and its 'allowed' was obeyed"
        f" (allowed={decision.allowed})"
    )
