"""The dashboard behind a TLS-terminating proxy: its session cookie stays ``Secure`` and the
scheme it trusts is the one a named proxy reports.

Attack (found in the eighth session's review): the cookie's ``Secure`` flag followed the
request's own scheme, and kvgov's uvicorn believed ``X-Forwarded-Proto`` from loopback only, so
behind an ingress (another address) every request looked like plain HTTP: the session cookie
went out without ``Secure``, and a later plain-HTTP request to the same host (a typed
``http://`` URL, a downgrade) carried the session in the clear. In production the cookie is now
always ``Secure``, and ``api.forwarded_allow_ips`` names the proxies whose forwarded scheme is
believed (anyone else's is not).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from sqlalchemy.orm import Session

from kvgov.config import ApiSettings, load_settings
from kvgov.db.tokens import TokenRepository
from kvgov.errors import ConfigError
from kvgov.types import Role
from tests.security import doors
from tests.security.test_resource_api import api_server

pytestmark = pytest.mark.postgres

FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def _auditor(sc: object) -> str:
    with Session(sc.engine) as s:  # type: ignore[attr-defined]
        _, raw = TokenRepository(s).create(Role.AUDITOR)
        s.commit()
    return raw


async def _sign_in(port: int, token: str, headers: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        return await client.post(
            "/dashboard/login",
            content=f"token={token}",
            headers={**FORM, "Host": "kvgov.test", **headers},
            follow_redirects=False,
        )


async def test_in_production_the_session_cookie_is_secure_whatever_the_scheme(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc, api_server(sc) as port:
        token = _auditor(sc)
        # a TLS proxy that forwarded the request as plain HTTP, not named as a proxy
        signed_in = await _sign_in(port, token, {})
        assert signed_in.status_code == 303, signed_in.text
        cookie = signed_in.headers["set-cookie"]
        assert cookie.startswith("kvgov_dashboard=")
        assert "secure" in cookie.lower().split("; "), cookie


async def test_only_named_proxies_set_the_scheme(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """A browser on https://kvgov.test behind an ingress: its sign-in's ``Origin`` is https,
    which matches only when the ingress (here the test, on loopback) is a named proxy whose
    ``X-Forwarded-Proto`` is believed; anyone else's forwarded scheme is not."""
    browser = {"Origin": "https://kvgov.test", "X-Forwarded-Proto": "https"}
    async with doors.sidecar(tmp_path, prod_db) as sc:
        token = _auditor(sc)
        async with api_server(sc, forwarded_allow_ips=["127.0.0.0/8"]) as port:  # a network
            named = await _sign_in(port, token, browser)
        assert named.status_code == 303, named.text
        async with api_server(sc, forwarded_allow_ips=["10.0.0.0/8"]) as port:
            stranger = await _sign_in(port, token, browser)
        assert stranger.status_code == 403  # the https it claims is not believed
        assert "set-cookie" not in stranger.headers


def test_production_refuses_a_cookie_without_secure(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"api\.secure_cookies=false"):
        load_settings(
            environment="production",
            database={"url": "postgresql+psycopg://kvgov@db/kvgov", "runtime_role": "rt"},
            keys={"kek_path": str(tmp_path / "kek.key")},
            dataplane={"engine_tokens": {"t0ken-value": "engine-a"}},
            api={"secure_cookies": False},
        )
    assert ApiSettings(secure_cookies=False).secure_cookies is False  # development may
