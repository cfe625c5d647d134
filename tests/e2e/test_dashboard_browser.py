"""Drive /dashboard in headless Chromium: sign in through the form, compare the numbers shown
with the API's, and save a screenshot under ``test-artifacts/``.

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
    assert shot.stat().st_size > 10_000
