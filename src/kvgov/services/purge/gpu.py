"""Reset the GPU prefix cache of configured vLLM engines (``POST {url}/reset_prefix_cache``).

vLLM offers only a whole-cache reset (and only with ``VLLM_SERVER_DEV_MODE=1``): nothing per
tenant or user. The purge records each engine's answer; an engine that does not answer 2xx
makes the purge ``incomplete``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GpuResetResult:
    engine: str
    ok: bool
    status: int | None
    error: str | None = None


async def reset_prefix_caches(urls: list[str], *, timeout_s: float) -> list[GpuResetResult]:
    """POST ``/reset_prefix_cache`` to every engine concurrently; never raises."""
    if not urls:
        return []
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        return list(await asyncio.gather(*(_reset_one(client, u) for u in urls)))


async def _reset_one(client: httpx.AsyncClient, url: str) -> GpuResetResult:
    target = url.rstrip("/") + "/reset_prefix_cache"
    try:
        resp = await client.post(target)
    except httpx.HTTPError as exc:
        log.warning("purge.gpu.unreachable", extra={"engine": url, "error": type(exc).__name__})
        return GpuResetResult(url, ok=False, status=None, error=f"{type(exc).__name__}: {exc}")
    ok = 200 <= resp.status_code < 300
    if not ok:
        log.warning("purge.gpu.refused", extra={"engine": url, "status": resp.status_code})
    return GpuResetResult(
        url, ok=ok, status=resp.status_code, error=None if ok else resp.text[:200] or None
    )
