"""A real LMCache 0.5.6 engine on CPU, for tests and benchmarks.

LMCache ships no CPU "GPU connector" that moves bytes (its ``MockGPUConnector`` does nothing),
so :class:`CpuKVConnector` stands in for the GPU paged KV buffer: a CPU tensor shaped
``[2, layers, slots, heads * head_dim]`` addressed through a ``slot_mapping``. Everything else
is LMCache's own code: ``LMCacheEngineBuilder``, the storage manager, the local CPU tier, the
remote backends, the built-in ``lm://`` connector and ``lmcache_server``.

Builders here make engines with either kvgov's connector (``remote_storage_plugins: ["kvgov"]``)
or LMCache's built-in ``remote_url: lm://host:port``. Each engine gets its own instance id, so
several independent engines (think: two vLLM workers on two hosts) live in one process.
Import this module only from tests marked ``lmcache``: it imports torch and lmcache.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata

from kvgov.connectors.lmcache.cpu import CpuKVConnector as _CpuKV

MODEL = "kvgov-test/tiny"
TENANT_TAG = "lmcache.tag.tenant"
USER_TAG = "lmcache.tag.user"
REQUEST_ID = "lmcache.kvgov.request_id"
AUTH_TENANT = "lmcache.kvgov.tenant"
ACTING_USER = "lmcache.kvgov.user"
SENSITIVITY = "lmcache.kvgov.sensitivity"


@dataclass(frozen=True)
class Geometry:
    """A tiny model: bytes per chunk = 2 * layers * heads * head_dim * 2 (bf16) * chunk."""

    layers: int = 2
    heads: int = 2
    head_dim: int = 32
    chunk: int = 256
    slots: int = 4096
    dtype: torch.dtype = torch.bfloat16

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def chunk_bytes(self) -> int:
        return 2 * self.layers * self.hidden * self.dtype.itemsize * self.chunk


class CpuKVConnector(_CpuKV):
    """Stand-in for the GPU paged KV cache (see ``kvgov.connectors.lmcache.cpu``)."""

    def __init__(self, geometry: Geometry) -> None:
        super().__init__(geometry.layers, geometry.hidden, geometry.slots, geometry.dtype)
        self.geometry = geometry


def metadata(geometry: Geometry) -> LMCacheMetadata:
    g = geometry
    return LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=g.dtype,
        kv_shape=(g.layers, 2, g.chunk, g.heads, g.head_dim),
        chunk_size=g.chunk,
        role="worker",
    )


def kvgov_config(
    endpoint: str,
    *,
    token: str = "",
    engine_id: str = "engine-test",
    geometry: Geometry | None = None,
    cpu_staging_gb: float = 0.05,
    local_cpu: bool = False,
    local_disk: Path | None = None,
    extra: Mapping[str, Any] | None = None,
) -> LMCacheEngineConfig:
    """LMCache config with kvgov as its only remote tier.

    ``local_cpu=False`` (the governed default) keeps the CPU tier as a staging buffer only, so
    every hit goes through kvgov; ``True`` also caches in the engine's CPU tier (EVICT tests).
    ``local_disk`` adds LMCache's local disk tier in that directory (0.1 GB).
    """
    g = geometry or Geometry()
    extra_config: dict[str, Any] = {
        "remote_storage_plugin.kvgov.module_path": "kvgov.connectors.lmcache",
        "remote_storage_plugin.kvgov.class_name": "KvgovConnector",
        "kvgov.endpoint": endpoint,
        "kvgov.engine_id": engine_id,
    }
    if token:
        extra_config["kvgov.token"] = token
    extra_config.update(extra or {})
    return LMCacheEngineConfig.from_defaults(
        chunk_size=g.chunk,
        local_cpu=local_cpu,
        max_local_cpu_size=cpu_staging_gb,
        local_disk=f"{local_disk}/" if local_disk is not None else None,
        max_local_disk_size=0.1 if local_disk is not None else 0.0,
        remote_url=None,
        remote_storage_plugins=["kvgov"],
        extra_config=extra_config,
    )


def lm_config(
    url: str, *, geometry: Geometry | None = None, cpu_staging_gb: float = 0.05
) -> LMCacheEngineConfig:
    """LMCache config with the built-in ``lm://`` connector as its only remote tier."""
    g = geometry or Geometry()
    return LMCacheEngineConfig.from_defaults(
        chunk_size=g.chunk,
        local_cpu=False,
        max_local_cpu_size=cpu_staging_gb,
        local_disk=None,
        remote_url=url,
        remote_serde="naive",
    )


def local_config(*, geometry: Geometry | None = None, cpu_gb: float = 0.05) -> LMCacheEngineConfig:
    """LMCache config with only its local CPU tier (no remote)."""
    g = geometry or Geometry()
    return LMCacheEngineConfig.from_defaults(
        chunk_size=g.chunk, local_cpu=True, max_local_cpu_size=cpu_gb, local_disk=None
    )


@dataclass
class Engine:
    """One real ``LMCacheEngine`` plus the CPU KV buffer it reads from and writes to."""

    instance_id: str
    engine: LMCacheEngine
    gpu: CpuKVConnector
    geometry: Geometry
    closed: bool = field(default=False)

    # --- data ------------------------------------------------------------------------------
    def fill(self, num_tokens: int, seed: int) -> torch.Tensor:
        """Write random KV for slots ``[0, num_tokens)``; return a copy of what was written."""
        gen = torch.Generator().manual_seed(seed)
        data = torch.randn(
            (2, self.geometry.layers, num_tokens, self.geometry.hidden), generator=gen
        ).to(self.geometry.dtype)
        self.gpu.kv[:, :, :num_tokens, :] = data
        return data.clone()

    def zero(self) -> None:
        self.gpu.kv.zero_()

    def kv_bytes(self, num_tokens: int) -> bytes:
        view = self.gpu.kv[:, :, :num_tokens, :].contiguous()
        return view.view(torch.uint8).numpy().tobytes()

    # --- LMCache operations --------------------------------------------------------------
    def store(
        self,
        tokens: list[int],
        request_configs: Mapping[str, str] | None = None,
        *,
        skip_prefix: int = 0,
    ) -> None:
        """Store ``tokens``; ``skip_prefix`` tokens (whole chunks) are already cached and are
        not stored again, as vLLM's LMCache connector does after a lookup hit."""
        mask = None
        if skip_prefix:
            mask = torch.ones(len(tokens), dtype=torch.bool)
            mask[:skip_prefix] = False
        self.engine.store(
            torch.tensor(tokens, dtype=torch.long),
            mask=mask,
            slot_mapping=torch.arange(len(tokens), dtype=torch.long),
            request_configs=dict(request_configs or {}),
        )

    def lookup(self, tokens: list[int], request_configs: Mapping[str, str] | None = None) -> int:
        return int(
            self.engine.lookup(
                torch.tensor(tokens, dtype=torch.long), request_configs=dict(request_configs or {})
            )
        )

    def retrieve(self, tokens: list[int], request_configs: Mapping[str, str] | None = None) -> int:
        """Load cached KV into slots ``[0, len(tokens))``; return how many tokens were loaded."""
        mask = self.engine.retrieve(
            torch.tensor(tokens, dtype=torch.long),
            slot_mapping=torch.arange(len(tokens), dtype=torch.long),
            request_configs=dict(request_configs or {}),
        )
        return int(mask.sum().item())

    def clear(self, tokens: list[int], request_configs: Mapping[str, str] | None = None) -> int:
        return int(
            self.engine.clear(
                torch.tensor(tokens, dtype=torch.long), request_configs=dict(request_configs or {})
            )
        )

    def key_strings(
        self, tokens: list[int], request_configs: Mapping[str, str] | None = None
    ) -> list[str]:
        """The LMCache key strings of the full chunks of ``tokens``, in order."""
        db = self.engine.token_database
        out = []
        for _start, _end, key in db.process_tokens(
            tokens=torch.tensor(tokens, dtype=torch.long),
            request_configs=dict(request_configs or {}),
        ):
            out.append(key.to_string())
        return out

    def local_cpu_hits(
        self, tokens: list[int], request_configs: Mapping[str, str] | None = None
    ) -> int:
        """How many prefix tokens the engine's own CPU tier holds."""
        return self.local_hits(tokens, request_configs, "LocalCPUBackend")

    def local_hits(
        self, tokens: list[int], request_configs: Mapping[str, str] | None, tier: str
    ) -> int:
        """How many prefix tokens one of the engine's own tiers holds (``LocalCPUBackend``,
        ``LocalDiskBackend``)."""
        return int(
            self.engine.lookup(
                torch.tensor(tokens, dtype=torch.long),
                search_range=[tier],
                request_configs=dict(request_configs or {}),
            )
        )

    def local_backend(self, tier: str) -> Any:
        """One of the engine's own storage backends by LMCache's name, or None."""
        return self.engine.storage_manager.storage_backends.get(tier)

    # --- introspection -------------------------------------------------------------------
    def remote_backends(self) -> list[Any]:
        manager = self.engine.storage_manager
        if manager is None:
            return []
        return [b for name, b in manager.storage_backends.items() if "Remote" in type(b).__name__]

    def remote_connector(self) -> Any:
        """The connector object inside the first remote backend (unwrapped)."""
        backends = self.remote_backends()
        if not backends or backends[0].connection is None:
            return None
        conn = backends[0].connection
        return conn.getWrappedConnector() if hasattr(conn, "getWrappedConnector") else conn

    def wait_remote_puts(self, timeout_s: float = 20.0) -> None:
        """Wait until every async remote put this engine submitted has finished."""
        # LMCache tracks single puts in ``put_tasks`` but not batched ones: the kvgov connector
        # counts its own in-flight operations
        deadline = time.monotonic() + timeout_s
        for backend in self.remote_backends():
            # LMCache submits puts to its loop in order: once a later no-op has run, every
            # earlier put coroutine has started (and the connector has counted it)
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), backend.loop).result(timeout_s)
        while time.monotonic() < deadline:
            pending = False
            for backend in self.remote_backends():
                conn = backend.connection
                inner = conn.getWrappedConnector() if hasattr(conn, "getWrappedConnector") else conn
                wait_idle = getattr(inner, "wait_idle", None)
                if backend.put_tasks or (
                    wait_idle is not None and not wait_idle(max(0.0, deadline - time.monotonic()))
                ):
                    pending = True
            if not pending:
                return
            time.sleep(0.005)
        raise TimeoutError("remote puts still pending")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.wait_remote_puts()  # LMCache frees its CPU buffers before closing remote backends
        manager = self.engine.storage_manager
        LMCacheEngineBuilder.destroy(self.instance_id)
        # LMCache stops its storage loop but never closes it (its self-pipe sockets leak)
        loop = getattr(manager, "loop", None)
        if loop is not None and not loop.is_running() and not loop.is_closed():
            loop.close()


def build_engine(
    config: LMCacheEngineConfig, geometry: Geometry | None = None, name: str = "engine"
) -> Engine:
    """Build and post-init a real engine under a fresh instance id."""
    g = geometry or Geometry()
    instance_id = f"{name}-{uuid.uuid4().hex[:8]}"
    gpu = CpuKVConnector(g)
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id, config, metadata(g), gpu, lambda t, i: None, lambda o, i: o
    )
    engine.post_init()
    return Engine(instance_id=instance_id, engine=engine, gpu=gpu, geometry=g)


@contextmanager
def engines(
    *configs: LMCacheEngineConfig, geometry: Geometry | None = None
) -> Iterator[list[Engine]]:
    """Several independent engines, destroyed afterwards."""
    built: list[Engine] = []
    try:
        for i, cfg in enumerate(configs):
            built.append(build_engine(cfg, geometry, name=f"engine{i}"))
        yield built
    finally:
        for e in built:
            e.close()


def tokens(n: int, seed: int = 0) -> list[int]:
    """``n`` deterministic pseudo-random token ids."""
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(1, 32_000, (n,), generator=gen)]


def identity(
    tenant: str | None = None,
    *,
    user_scope: str | None = None,
    request_id: str | None = None,
    user: str | None = None,
    sensitivity: str | None = None,
    auth_tenant: str | None = None,
) -> dict[str, str]:
    """``request_configs`` as a gateway would set them: tenant tag first, then user tag."""
    cfg: dict[str, str] = {}
    if tenant is not None:
        cfg[TENANT_TAG] = tenant
    if user_scope is not None:
        cfg[USER_TAG] = user_scope
    if request_id is not None:
        cfg[REQUEST_ID] = request_id
    if user is not None:
        cfg[ACTING_USER] = user
    if sensitivity is not None:
        cfg[SENSITIVITY] = sensitivity
    if auth_tenant is not None:
        cfg[AUTH_TENANT] = auth_tenant
    return cfg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(host: str, port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port}")


@contextmanager
def lmcache_server(port: int | None = None) -> Iterator[str]:
    """LMCache's own ``lmcache_server`` in a subprocess; yields its ``lm://`` URL."""
    port = port or free_port()
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_port("127.0.0.1", port)
        yield f"lm://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- a real kvgov sidecar ---------------------------------------------------------------------


#: the engine id a test's ``lm://`` listener is declared as (:func:`lm_env`)
LM_ENGINE = "lm-engine"


def lm_env(tenants: list[str]) -> dict[str, str]:
    """``KVGOV_*`` settings that turn the ``lm://`` listener on (a free port) for ``tenants``."""
    return {
        "KVGOV_DATAPLANE__LM_PORT": "0",
        "KVGOV_DATAPLANE__LM_ENGINE_ID": LM_ENGINE,
        "KVGOV_DATAPLANE__LM_TENANTS": json.dumps(tenants),
    }


def policy_data(tenants: list[str], base: Path | None = None) -> dict[str, Any]:
    """The shipped policy data document with ``tenants`` enabled for every engine (and for
    the ``lm://`` listener when it is declared as :data:`LM_ENGINE`: ``"*"`` does not admit it)."""
    base = base or Path(__file__).resolve().parents[1] / "src/kvgov/policy/rego/data.json"
    data: dict[str, Any] = json.loads(base.read_text())
    data["tenants"] = {t: {"enabled": True, "engines": ["*", LM_ENGINE]} for t in tenants}
    data["revision"] = "test-" + "-".join(tenants)
    return data


def sidecar_env(
    data_dir: Path,
    *,
    tenants: list[str],
    database_url: str = "",
    governance: bool = True,
    tiers: list[str] | None = None,
) -> dict[str, str]:
    """``KVGOV_*`` settings for a development sidecar in ``data_dir`` on a Unix socket."""
    data_dir.mkdir(parents=True, exist_ok=True)
    data_file = data_dir / "policy-data.json"
    data_file.write_text(json.dumps(policy_data(tenants)))
    env = {
        "KVGOV_DATA_DIR": str(data_dir),
        "KVGOV_LOG_LEVEL": "warning",
        "KVGOV_DATAPLANE__HOST": "",
        "KVGOV_DATAPLANE__UNIX_PATH": str(data_dir / "data.sock"),
        "KVGOV_DATAPLANE__LM_PORT": "-1",
        "KVGOV_POLICY__DATA_FILE": str(data_file),
        "KVGOV_TIERS__FILESYSTEM_FSYNC": "false",
    }
    if not governance:  # the named null collaborators (development only)
        env["KVGOV_POLICY__ENGINE"] = "unsafe-allow-all"
        env["KVGOV_DATAPLANE__SEALER"] = "unsafe-plaintext"
        env["KVGOV_DATAPLANE__EVENTS"] = "unsafe-null"
    if database_url:
        env["KVGOV_DATABASE__URL"] = database_url
    if tiers:
        env["KVGOV_TIERS__CHAIN"] = json.dumps(tiers)
    return env


def _settings_from(env: Mapping[str, str]) -> Any:
    from kvgov.config import load_settings

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return load_settings()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _policy_for(settings: Any) -> Any:
    """The configured policy engine (None: let the sidecar build it from settings).

    Stand-in only while ``kvgov.policy.factory`` is missing: the embedded Rego engine on the
    shipped policies and the settings' data file, which is what the factory builds by default.
    """
    try:
        import kvgov.policy.factory  # noqa: F401
    except ImportError:
        from kvgov.policy.embedded import EmbeddedPolicyEngine

        return EmbeddedPolicyEngine.from_paths(
            settings.policy.policy_dir, settings.policy.data_file
        )
    return None


class SidecarThread:
    """The real sidecar (``kvgov.proxy.app.build_sidecar``) on its own event loop thread.

    In-process so tests can reach its pipeline, EVICT engines and stop/restart it on the same
    data directory and socket.
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.settings = _settings_from(self.env)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.sidecar: Any = None

    @property
    def endpoint(self) -> str:
        return f"unix://{self.settings.dataplane.unix_path}"

    def start(self, timeout_s: float = 60.0) -> SidecarThread:
        from kvgov.proxy.app import build_sidecar

        loop = asyncio.new_event_loop()
        self.loop = loop
        self.thread = threading.Thread(target=loop.run_forever, name="kvgov-sidecar", daemon=True)
        self.thread.start()

        async def boot() -> Any:
            sidecar = await build_sidecar(self.settings, policy=_policy_for(self.settings))
            await sidecar.start()
            return sidecar

        try:
            self.sidecar = asyncio.run_coroutine_threadsafe(boot(), loop).result(timeout_s)
        except BaseException:
            self._stop_loop()
            raise
        return self

    def call(self, coro: Any, timeout_s: float = 30.0) -> Any:
        if self.loop is None:
            raise RuntimeError("sidecar is not running")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def flush(self) -> None:
        """Wait until every ledger event the sidecar queued is written."""
        if self.sidecar.writer is not None:
            self.call(self.sidecar.writer.flush())

    def session(self) -> Any:
        """A SQLAlchemy session on the sidecar's ledger (flushes the writer first)."""
        from kvgov.db.engine import make_sessionmaker

        self.flush()
        return make_sessionmaker(self.sidecar.engine)()

    def key_digest(self, raw_key: str) -> str:
        return str(self.sidecar.pipeline.pseudonymizer.key_digest(raw_key))

    def pseudonym(self, tenant: str, user: str) -> str:
        return str(self.sidecar.pipeline.pseudonymizer.user(tenant, user))

    def evict(self, digests: list[str], tenant: str, timeout_s: float = 10.0) -> list[Any]:
        """Send EVICT for the entries of ``tenant`` with those key digests to the connected
        engines that may hold its data; the per-engine results."""
        return list(
            self.call(self.sidecar.server.evict_on_engines(digests, timeout_s, tenant=tenant))
        )

    def stop(self) -> None:
        if self.sidecar is not None:
            self.call(self.sidecar.stop(grace_s=5.0), timeout_s=60.0)
            self.sidecar = None
        self._stop_loop()

    def _stop_loop(self) -> None:
        loop, thread = self.loop, self.thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        self.loop = self.thread = None


@contextmanager
def sidecar(
    data_dir: Path, *, tenants: list[str], database_url: str = ""
) -> Iterator[SidecarThread]:
    """A running in-process sidecar, stopped afterwards."""
    sc = SidecarThread(sidecar_env(data_dir, tenants=tenants, database_url=database_url)).start()
    try:
        yield sc
    finally:
        sc.stop()


@contextmanager
def kvgov_sidecar(
    data_dir: Path,
    *,
    tenants: list[str],
    governance: bool = True,
    tiers: list[str] | None = None,
    tcp: bool = False,
) -> Iterator[str]:
    """The real sidecar in a subprocess (for benchmarks); yields its ``unix://`` endpoint, or
    with ``tcp`` its ``tcp://127.0.0.1:port`` one (it listens on both then)."""
    env = sidecar_env(data_dir, tenants=tenants, governance=governance, tiers=tiers)
    endpoint = f"unix://{env['KVGOV_DATAPLANE__UNIX_PATH']}"
    if tcp:
        port = free_port()
        env |= {"KVGOV_DATAPLANE__HOST": "127.0.0.1", "KVGOV_DATAPLANE__PORT": str(port)}
        endpoint = f"tcp://127.0.0.1:{port}"
    sock = Path(env["KVGOV_DATAPLANE__UNIX_PATH"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.lmcache_harness", "serve"],
        env=dict(os.environ, **env),
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("kvgov sidecar did not start")
            time.sleep(0.05)
        yield endpoint
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _serve_forever() -> None:
    """``python -m tests.lmcache_harness serve``: run a sidecar from ``KVGOV_*`` until SIGTERM."""
    from kvgov.config import load_settings
    from kvgov.proxy.app import build_sidecar

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        settings = load_settings()
        sc = await build_sidecar(settings, policy=_policy_for(settings))
        await sc.start()
        await stop.wait()
        await sc.stop(grace_s=5.0)

    asyncio.run(run())


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    _serve_forever()
