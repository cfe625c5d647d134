"""Drive /dashboard in headless Chromium: sign in through the form, compare the numbers shown
with the API's (tenant stats, integrity, and the erasure requests of real purges: id, state,
counts, receipt verified), and save a screenshot under ``test-artifacts/``.

The API runs under uvicorn on a loopback port over a real, seeded Postgres ledger; Chromium is
driven over the DevTools protocol (aiohttp's websocket client), so the real sign-in form, the
redirect and the session cookie are exercised exactly as a person would.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from kvgov.db.keystore import SqlKeyStore
from kvgov.db.purge_views import PurgeRequest
from kvgov.keys.kek import FileKekProvider
from kvgov.keys.keyring import Keyring
from tests.integration.test_api_support import EXPECTED_STATS, ApiWorld, api_world, bearer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.postgres,
    pytest.mark.skipif(
        CHROMIUM is None, reason="chromium is not installed (.ci/run installs Debian's chromium)"
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def served(pg_url: str, tmp_path: Path) -> Iterator[tuple[ApiWorld, str]]:
    with api_world(pg_url, tmp_path) as world:
        # real purges through the purge service on the same database: alice's, run to the end
        # (signed receipt), and a whole-tenant purge of globex still waiting for its executor.
        # Her chunks are first sealed (her own key for the one scoped to her) and put in the
        # tier the purge deletes from, as a sidecar would have.
        asyncio.run(_store_alices_chunks(world))
        world.ids["done"] = asyncio.run(world.purge("acme", "alice@acme.example")).id
        world.ids["pending"] = asyncio.run(
            world.purges.create(PurgeRequest(tenant="globex", requested_by="test"))
        ).id
        port = _free_port()
        config = uvicorn.Config(world.app, host="127.0.0.1", port=port, log_level="warning")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        try:
            yield world, f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(timeout=10)


async def _store_alices_chunks(world: ApiWorld) -> None:
    ring = Keyring(SqlKeyStore(world.engine), FileKekProvider(world.settings.kek_path))
    alice = world.seeded.users["alice@acme.example"]
    for name, user in (("a1", None), ("a2", None), ("a3", alice)):
        digest = world.seeded.digests[name]
        sealed = ring.seal("acme", digest.encode(), f"{name} ".encode() * 500, user=user)
        await world.memory.put(digest, sealed)


class Cdp:
    """The few DevTools protocol calls this test needs."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self._ids)
        await self._ws.send_json({"id": ident, "method": method, "params": params})
        while True:
            msg = await asyncio.wait_for(self._ws.receive_json(), timeout=30)
            if msg.get("id") == ident:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))
            self.events.append(msg)

    async def wait_event(self, method: str, within_s: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + within_s
        while True:
            for i, event in enumerate(self.events):
                if event.get("method") == method:
                    return self.events.pop(i)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(method)
            self.events.append(await asyncio.wait_for(self._ws.receive_json(), remaining))

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")


def _start_chromium(profile: Path) -> tuple[subprocess.Popen[bytes], int]:
    assert CHROMIUM is not None
    proc = subprocess.Popen(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--no-first-run",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            "--window-size=1400,1800",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("chromium did not start its DevTools endpoint")
        time.sleep(0.1)
    return proc, int(port_file.read_text().split()[0])


async def _drive(devtools_port: int, base: str, token: str) -> tuple[dict[str, Any], bytes]:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{devtools_port}/json/list") as resp:
            targets = await resp.json()
        page = next(t for t in targets if t["type"] == "page")
        async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            cdp = Cdp(ws)
            await cdp.call("Page.enable")
            await cdp.call("Page.navigate", url=f"{base}/dashboard")
            await cdp.wait_event("Page.loadEventFired")
            assert await cdp.evaluate("document.title") == "Sign in · kvgov compliance"
            # sign in the way a person does: type the token, submit the form
            await cdp.evaluate(
                f"document.getElementById('token').value = {json.dumps(token)};"
                "document.querySelector('form').submit(); true"
            )
            await cdp.wait_event("Page.loadEventFired")
            data = await cdp.evaluate(
                """(() => {
                  const out = {title: document.title, tenants: {}, integrity: null,
                               denials: document.querySelectorAll('tr.denial').length,
                               cookieVisibleToJs: document.cookie.includes('kvgov')};
                  const badge = document.querySelector('[data-integrity]');
                  out.integrity = badge ? badge.dataset.integrity : null;
                  for (const row of document.querySelectorAll('tr[data-tenant]')) {
                    const t = {};
                    for (const cell of row.querySelectorAll('[data-stat]')) {
                      t[cell.dataset.stat] = cell.dataset.value ?? cell.textContent.trim();
                    }
                    out.tenants[row.dataset.tenant] = t;
                  }
                  out.purges = {};
                  for (const row of document.querySelectorAll('tr.purge')) {
                    const p = {state: row.dataset.state};
                    for (const cell of row.querySelectorAll('[data-purge]')) {
                      p[cell.dataset.purge] = cell.textContent.trim();
                    }
                    const receipt = row.querySelector('[data-receipt]');
                    p.receipt = receipt ? receipt.dataset.receipt : null;
                    out.purges[row.dataset.purgeId] = p;
                  }
                  return out;
                })()"""
            )
            shot = await cdp.call(
                "Page.captureScreenshot", format="png", captureBeyondViewport=True
            )
            return dict(data), base64.b64decode(shot["data"])


def test_dashboard_shows_the_same_numbers_as_the_api(
    served: tuple[ApiWorld, str], tmp_path: Path
) -> None:
    world, base = served
    api = httpx.get(f"{base}/v1/stats", headers=bearer(world.tokens.auditor), timeout=30).json()
    verify = httpx.get(f"{base}/v1/audit/verify", headers=bearer(world.tokens.auditor)).json()
    purges = httpx.get(f"{base}/v1/purges", headers=bearer(world.tokens.auditor)).json()["items"]

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    proc, devtools_port = _start_chromium(tmp_path / "chromium-profile")
    try:
        shown, png = asyncio.run(_drive(devtools_port, base, world.tokens.auditor))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()

    shot.write_bytes(png)
    assert shown["title"] == "kvgov compliance"
    assert shown["cookieVisibleToJs"] is False  # HttpOnly
    assert shown["integrity"] == ("ok" if verify["ok"] else "broken")
    assert shown["denials"] == 1
    assert set(shown["tenants"]) == {t["tenant"] for t in api["tenants"]} == set(EXPECTED_STATS)
    for t in api["tenants"]:
        page = shown["tenants"][t["tenant"]]
        assert int(page["entries"]) == t["entries"]
        assert int(page["puts"]) == t["puts"]
        assert int(page["hits"]) == t["hits"]
        assert int(page["misses"]) == t["misses"]
        assert int(page["denials"]) == t["denials"]
        assert page["hit_rate"] == f"{t['hit_rate'] * 100:.1f}%"
        for tier, nbytes in t["live_bytes_by_tier"].items():
            assert int(page[f"bytes-{tier}"]) == nbytes

    # the erasure requests: the same jobs as /v1/purges, same state and counts, and the
    # finished purge's receipt shown as verified (the API says its signature is valid)
    assert [p["id"] for p in purges] == [world.ids["pending"], world.ids["done"]]
    assert set(shown["purges"]) == {p["id"] for p in purges}
    for p in purges:
        row = shown["purges"][p["id"]]
        assert row["state"] == p["state"]
        assert row["receipt"] == (
            "pending"
            if not p["receipt"]["present"]
            else "verified"
            if p["receipt"]["signature_valid"]
            else "invalid"
        )
        counts = p["counts"]
        for name in ("entries_purged", "entries_in_scope", "keys_destroyed"):
            expected = "-" if counts[name] is None else str(counts[name])
            assert row.get(name, "-") == expected, (name, row)
        for tier, n in counts["deleted_by_tier"].items():
            assert int(row[f"deleted-{tier}"]) == n
    done = shown["purges"][world.ids["done"]]
    assert done["state"] == "completed" and done["receipt"] == "verified"
    assert done["entries_purged"] == "3" and done["entries_in_scope"] == "3"
    assert done["deleted-memory"] == "3" and done["keys_destroyed"] == "1"
    assert shown["purges"][world.ids["pending"]]["receipt"] == "pending"
    assert shot.stat().st_size > 10_000
