"""The one ``Settings`` model.

Sources, highest priority first: explicit keyword arguments, ``KVGOV_*`` environment variables
(nested with ``__``, e.g. ``KVGOV_DATABASE__URL``; ``KVGOV_DATABASE_URL`` is accepted as a
shorthand), a TOML config file given with ``--config``, a defaults TOML file named by
``KVGOV_DEFAULTS_FILE`` (the sidecar image's: its paths and listeners), then the embedded
defaults. A packaging's defaults sit below everything an operator writes: as ``ENV`` they would
silently override a ``--config`` file.

The embedded defaults run a single-node sidecar with nothing else installed: a SQLite ledger and
key files under ``./.kvgov/``, the embedded Rego engine, memory + filesystem tiers. Unknown keys
are errors, and :meth:`Settings.check_safe` refuses unsafe combinations in production.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import os
import re
import tomllib
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote_plus, urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from kvgov.engine_ids import ENGINE_ID_MAX, engine_id_problem, id_text_problem
from kvgov.errors import ConfigError
from kvgov.privatefs import read_guarded_file
from kvgov.types import Environment
from kvgov.urlreach import POSTGRES_CURE, Reach, postgres_reach, redis_reach
from kvgov.wire.codec import utf8

_MIB = 1024 * 1024
#: addresses that reach only this host (a pod's own network namespace, in Kubernetes)
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})

TierName = Literal["memory", "filesystem", "redis"]
_DEFAULT_CHAIN: tuple[TierName, ...] = ("memory", "filesystem")
#: the filesystem tier's bound where ``tiers.filesystem_max_bytes`` is unset (development only)
DEV_FILESYSTEM_MAX_BYTES = 4 * 1024 * _MIB
_DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
#: bounds of ``tiers.shared_reconcile_interval_s`` (seconds; 0 is allowed too: start only)
_MIN_RECONCILE_S = 0.1
_MAX_RECONCILE_S = 30 * 86_400.0

#: the ``--config`` file for the settings being built (set only inside :func:`load_settings`)
_CONFIG_FILE: ContextVar[Path | None] = ContextVar("kvgov_config_file", default=None)
#: the variable naming a packaging's defaults file (the image sets it): not a setting, it names
#: the lowest-priority source, below ``--config``
DEFAULTS_FILE_ENV = "KVGOV_DEFAULTS_FILE"
#: that file, for the settings being built (set only inside :func:`load_settings`)
_DEFAULTS_FILE: ContextVar[Path | None] = ContextVar("kvgov_defaults_file", default=None)


def parse_public_key(text: str) -> bytes:
    """The raw 32 bytes of an Ed25519 public key written as ``ed25519:<base64>`` (or bare
    base64 of the 32 bytes), as ``kvgov audit public-key`` prints it."""
    body = text.strip().removeprefix("ed25519:")
    try:
        raw = base64.b64decode(body.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a trusted key must be ed25519:<base64 of 32 bytes>") from None
    if len(raw) != 32:
        raise ValueError(f"a trusted key must be 32 bytes (ed25519:<base64>), got {len(raw)}")
    return raw


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DatabaseSettings(_Section):
    """Two roles (``docs/database.md``): the sidecar and the CLI connect as a runtime role that
    can append to the ledger but not change its schema; ``kvgov db upgrade`` migrates as the
    owner. Each URL comes from the setting or from a file (a mounted Secret), never both; a URL
    may hold a password, so it is a secret and never logged."""

    #: the runtime role's SQLAlchemy URL (``postgresql+psycopg://user:pw@host/db``); empty, with
    #: no ``url_file``, means ``sqlite:///<data_dir>/ledger.db``
    url: SecretStr = SecretStr("")
    #: a file holding the runtime URL (read when used; surrounding whitespace ignored)
    url_file: Path | None = None
    #: the owner role's URL, for ``kvgov db upgrade`` (and a development sidecar's own
    #: migration); empty, with no ``migration_url_file``, means the runtime URL
    migration_url: SecretStr = SecretStr("")
    migration_url_file: Path | None = None
    #: the role ``kvgov db upgrade`` grants the runtime privileges to (a group role the
    #: runtime login is a member of, or that login itself); empty: no grants
    runtime_role: str = Field(default="", pattern=r"^([a-z_][a-z0-9_$]{0,62})?$")
    pool_size: int = Field(default=5, ge=1, le=100)
    echo: bool = False
    #: migrations: longest wait for a table lock (a sidecar's open transaction) before the
    #: upgrade fails, rather than holding every sidecar's writes queued behind it; 0: no limit
    migration_lock_timeout_s: float = Field(default=10.0, ge=0.0, allow_inf_nan=False)
    #: migrations: longest run of one statement; 0: no limit
    migration_statement_timeout_s: float = Field(default=600.0, ge=0.0, allow_inf_nan=False)
    #: how long ``kvgov db upgrade`` waits for another process's upgrade to finish; 0: no limit
    migration_wait_s: float = Field(default=900.0, ge=0.0, allow_inf_nan=False)
    #: production refuses a URL (runtime or owner) that reaches beyond this host (not
    #: loopback, not a Unix socket) unless it says ``sslmode=verify-full`` (or ``verify-ca``)
    #: and ``sslrootcert`` itself (``docs/database.md``, "TLS"). Set this only where a service
    #: mesh encrypts and authenticates the connection to the database (mTLS); every start that
    #: uses it logs ``database.tls.unverified`` at WARNING
    cleartext_network_ok: bool = False

    @model_validator(mode="after")
    def _one_source_each(self) -> DatabaseSettings:
        if self.url.get_secret_value() and self.url_file is not None:
            raise ValueError("set database.url or database.url_file, not both")
        if self.migration_url.get_secret_value() and self.migration_url_file is not None:
            raise ValueError("set database.migration_url or database.migration_url_file, not both")
        return self


class LedgerSettings(_Section):
    #: identity of this writer's hash chain; empty means derived from the host name and data dir
    chain_id: str = ""
    #: Ed25519 private key (PEM) used to sign checkpoints and purge receipts
    signing_key_path: Path | None = None
    #: HMAC key used to pseudonymise user ids (never store raw ids)
    pseudonym_key_path: Path | None = None
    batch_max_events: int = Field(default=2000, ge=1, le=100_000)
    queue_max_events: int = Field(default=200_000, ge=1)
    #: how long an event nothing waits on (get, miss, exists, evict) may wait to share a commit;
    #: awaited events (puts, put denials) and ``flush()`` commit at once. 0: never wait
    lazy_max_delay_ms: float = Field(default=25.0, ge=0.0, le=10_000.0)
    #: seconds between automatic checkpoints while serving; 0 disables them
    checkpoint_interval_s: float = Field(default=60.0, ge=0.0)
    #: the lease a ``kvgov token``/``kvgov tenant`` command's session on the sidecar's chain
    #: signs: a command killed before its close explains rows appended beside it for this long
    #: at most (after it, the sidecar seals them foreign); a running command renews its session
    #: at half of it (``docs/ledger.md``, "Neighbour sessions")
    neighbour_session_max_s: int = Field(default=300, gt=0, le=3600)
    #: the sidecar acknowledges a put once its event is fsynced to a local journal and commits
    #: the journal to the database in large batches behind it (``docs/ledger.md``, "The local
    #: journal"); off: a put waits for its event's database commit
    journal: bool = True
    #: the journal's directory (local disk, one per sidecar); empty: ``<data_dir>/ledger-journal``
    journal_dir: Path | None = None
    #: a journal segment is closed at this size; segments the chain holds are deleted
    journal_segment_mib: int = Field(default=64, ge=1, le=4096)
    #: journal the events nothing waits on too (gets, misses, exists, evictions, expiries), so
    #: a crash loses none of them; off, they are durable within ``lazy_max_delay_ms``
    #: (what it costs: ``docs/ledger.md``, "Throughput")
    journal_lazy_events: bool = True
    #: the least time between the starts of two journal syncs while every waiting put is
    #: one its client streams more PUT frames behind (or nobody waits): what is appended
    #: within it shares one sync, so a streamed put's acknowledgement waits up to this much
    #: longer for far fewer syncs; a journal idle that long, or a put with nothing behind it
    #: (whoever else streams), syncs at once (``docs/ledger.md``, "The local journal"). 0:
    #: sync as soon as anything was appended
    journal_sync_interval_ms: float = Field(default=4.0, ge=0.0, le=1000.0)
    #: Ed25519 public keys ``audit verify`` trusts besides this node's own (the key of
    #: ``signing_key_path``): the keys of the fleet's other sidecars and CLI hosts, each as
    #: ``kvgov audit public-key`` prints it (``ed25519:<base64>``; a JSON list in
    #: ``KVGOV_LEDGER__TRUSTED_KEYS``). A chain signed by any other key fails verification
    trusted_keys: list[str] = Field(default_factory=list)
    #: a file of such keys, one per line (``#`` comments, PEM public keys also accepted), e.g. a
    #: mounted ConfigMap; read each time verification runs, and at start-up
    trusted_keys_file: Path | None = None

    @field_validator("trusted_keys")
    @classmethod
    def _keys_parse(cls, keys: list[str]) -> list[str]:
        for text in keys:
            parse_public_key(text)  # ValueError names what is wrong, never the key
        return keys


class PolicySettings(_Section):
    engine: Literal["embedded", "opa", "unsafe-allow-all"] = "embedded"
    #: operator's own Rego policy directory; empty means the policies shipped in the package
    policy_dir: Path | None = None
    #: data document (tenants, engines, class limits) as JSON; empty means the shipped example
    data_file: Path | None = None
    #: where OPA's REST API is: ``unix:///run/opa/opa.sock`` (production: a socket in a volume
    #: only the ``opa`` and ``kvgov`` containers mount, checked to be OPA's before anything is
    #: sent on it, see ``opa_uids``), ``https://host[:port]`` (OPA's certificate verified with
    #: the system's CAs) or ``http://host[:port]``. Production refuses ``http://`` on loopback:
    #: every container of the pod can bind OPA's port whenever OPA's process is gone and would
    #: then get the token and answer every decision (``docs/policy.md``, "OPA's own API")
    opa_url: str = "http://127.0.0.1:8181"
    #: the uids OPA may run as, for a ``unix://`` ``opa_url``: the socket must be owned by one
    #: of them and served by a process running as one (``SO_PEERCRED``); its directory owned by
    #: root, kvgov's uid or one of them. Unset: kvgov's own uid (root only when named)
    opa_uids: list[int] | None = None
    opa_timeout_s: float = Field(default=0.25, gt=0.0, le=30.0)
    #: the bearer token kvgov's requests to OPA carry (OPA started with
    #: ``--authentication=token --authorization=basic`` and a ``system.authz`` policy that
    #: admits it: ``docs/policy.md``, "OPA's own API"); or ``opa_token_file``, a file holding
    #: it (a mounted Secret, read at start-up, then followed: ``opa_token_reload_interval_s``),
    #: not both. ``engine = "opa"`` in production refuses neither set: an OPA that needs no
    #: token serves its policy and data to every process that reaches it, the inference
    #: engine's container in the pod included
    opa_token: SecretStr | None = None
    opa_token_file: Path | None = None
    #: the longest a running sidecar goes between looks at ``opa_token_file`` (a ``stat``,
    #: on the decision path): a rotated Secret's new token is sent from then on, the old one
    #: never again. It also looks at once whenever OPA refuses the token (401/403: then asks
    #: again, once, with the new token) and on every decision while the file's content is
    #: refused. 0: only then (``docs/policy.md``, "Rotating OPA's token")
    opa_token_reload_interval_s: float = Field(default=10.0, ge=0.0, le=3600.0)
    #: the longest a decision cached from OPA is served, in seconds (``engine = "opa"`` only;
    #: the embedded engine's cache is emptied by the reload that follows its sources). OPA's
    #: authority is its bundle, which can change without kvgov's ``policy_dir``/``data_file``
    #: changing (an engine revoked from a tenant): a cached allow outlives such a publish by at
    #: most this much. Must be > 0 (at most an hour); there is no "never"
    opa_decision_ttl_s: float = 10.0
    cache_max_entries: int = Field(default=65_536, ge=0)
    #: set when your own policies read the request id's value (the shipped ones do not): every
    #: request then misses the decision cache and records its own first allow
    cache_vary_on_request_id: bool = False
    #: seconds between a running sidecar's checks of ``policy_dir``/``data_file``: on a change
    #: it reloads them and drops its cached decisions (a revoked engine loses access within
    #: this); 0: never (a change then needs a restart)
    reload_interval_s: float = Field(default=10.0, ge=0.0, le=3600.0)

    @field_validator("opa_uids")
    @classmethod
    def _opa_uids_named(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(uid < 0 for uid in value)):
            raise ValueError("must name OPA's uids (integers >= 0), or be unset")
        return value

    @model_validator(mode="after")
    def _one_token_source(self) -> PolicySettings:
        if self.opa_token is not None and self.opa_token_file is not None:
            raise ValueError("set policy.opa_token or policy.opa_token_file, not both")
        return self

    @field_validator("opa_decision_ttl_s")
    @classmethod
    def _decision_ttl_bounded(cls, value: float) -> float:
        if not 0.0 < value <= 3600.0:  # not-a-number fails this too
            raise ValueError(
                f"must be seconds > 0 and <= 3600, got {value!r}: how long a decision cached "
                "from OPA may be served after OPA's bundle changed (0 would not mean 'no cache': "
                "use cache_max_entries = 0 for that)"
            )
        return value


class KeysSettings(_Section):
    kek_provider: Literal["file"] = "file"
    #: local key-encryption key file (0600); empty means ``<data_dir>/kek.key``
    kek_path: Path | None = None
    dek_cache_max: int = Field(default=4096, ge=1)
    segment_size: int = Field(default=1 * _MIB, ge=4096, le=64 * _MIB)
    #: rotate a data key after this many sealed chunks (GCM's random-nonce bound is 2**32)
    rotate_after_chunks: int = Field(default=2**28, ge=1, le=2**31)
    #: seconds between a sidecar's checks of its in-memory keys against the key store: about
    #: the longest a shred or rotation done elsewhere (CLI, another sidecar) goes unseen
    revalidate_interval_s: float = Field(default=5.0, gt=0, le=3600)


class TierSettings(_Section):
    #: tiers in lookup order; writes go through to all tiers the policy allows
    chain: list[TierName] = Field(default_factory=lambda: list(_DEFAULT_CHAIN))
    memory_max_bytes: int = Field(default=2 * 1024 * _MIB, ge=_MIB)
    #: filesystem tier root; empty means ``<data_dir>/tiers/fs``
    filesystem_path: Path | None = None
    filesystem_fsync: bool = True
    #: the most bytes the filesystem tier keeps on disk (each file counted whole, in blocks,
    #: with the puts being written): before a put would pass it, the least recently used
    #: entries are evicted (``kv:evict``, as the memory tier's), and a larger value is refused.
    #: Unset: :data:`DEV_FILESYSTEM_MAX_BYTES` in development; production refuses a chain with
    #: ``filesystem`` without it (a tier that grows until its volume is full gets the pod
    #: evicted, journal and all: ``docs/tiers.md``, "Disk bound"). Leave the tier's volume
    #: ~10% more room than this (its directories, a crash's leftovers). At least twice
    #: ``dataplane.buffer_pool_bytes`` (what puts in flight hold of it) and at least
    #: ``dataplane.max_frame_bytes`` (the largest value): start-up refuses less
    filesystem_max_bytes: int | None = Field(default=None, ge=_MIB)
    #: the Redis tier's URL (``redis://[:password@]host:port/db``); it may hold a password, so
    #: it is a secret and never logged. Empty, with no ``redis_url_file``, means
    #: ``redis://127.0.0.1:6379/0``
    redis_url: SecretStr = SecretStr("")
    #: a file holding that URL (a mounted Secret; read when used, surrounding whitespace
    #: ignored): set this or ``redis_url``, not both
    redis_url_file: Path | None = None
    #: production refuses a Redis URL beyond this host (not loopback, not ``unix://``) that is
    #: not ``rediss://`` with the server's certificate and name checked (``docs/tiers.md``).
    #: Set this only where a service mesh encrypts and authenticates the connection (mTLS);
    #: every start that uses it logs ``tiers.redis.tls_unverified`` at WARNING
    redis_cleartext_network_ok: bool = False
    redis_prefix: str = "kvgov:"
    #: seconds between TTL sweeps
    sweep_interval_s: float = Field(default=30.0, ge=0.1)
    #: seconds between a running sidecar's reconciles of its shared tiers (Redis) with the
    #: ledger, each interval jittered by +-10% so a fleet does not scan Redis all at once: the
    #: values a purge or deletion left there (made while no sidecar sharing it was alive, or
    #: whose Redis deletion failed) are deleted and recorded then, not only at the next start
    #: (docs/tiers.md). 0: only at start. Local tiers are reconciled at start only.
    shared_reconcile_interval_s: float = 3600.0

    @field_validator("shared_reconcile_interval_s")
    @classmethod
    def _reconcile_interval(cls, value: float) -> float:
        if value != 0 and not _MIN_RECONCILE_S <= value <= _MAX_RECONCILE_S:  # NaN fails too
            raise ValueError(
                f"must be 0 (reconcile shared tiers at start only) or seconds between "
                f"{_MIN_RECONCILE_S} and {_MAX_RECONCILE_S:.0f}, got {value!r}"
            )
        return value

    @model_validator(mode="after")
    def _one_source(self) -> TierSettings:
        if self.redis_url.get_secret_value() and self.redis_url_file is not None:
            raise ValueError("set tiers.redis_url or tiers.redis_url_file, not both")
        return self


#: what an engine id must be, as errors state it (:mod:`kvgov.engine_ids`)
ENGINE_ID_RULE = (
    f"1-{ENGINE_ID_MAX} printable characters, no surrounding blanks, not beginning with"
    ' "lm:", which names the lm:// listener\'s engine in receipts'
)


class DataPlaneSettings(_Section):
    #: kvgov wire protocol on TCP; empty host disables the TCP listener. The wire has no
    #: transport encryption (engine tokens, and values the sidecar opened for a get, cross it
    #: in the clear): production refuses a host other than loopback unless
    #: ``cleartext_network_ok`` says something else encrypts the pod's traffic
    host: str = "127.0.0.1"
    port: int = Field(default=7070, ge=0, le=65535)
    #: the TCP wire and the REST API without TLS may listen beyond loopback in production,
    #: and OPA may be asked over plain HTTP beyond it: only where a service mesh encrypts and
    #: authenticates pod-to-pod traffic (mTLS)
    cleartext_network_ok: bool = False
    #: kvgov wire protocol on a Unix socket; empty disables it
    unix_path: Path | None = None
    #: LMCache ``lm://`` compatibility listener (``docs/operations.md``, "Running lm://
    #: safely"): off (-1) unless configured; port 0 picks a free port. The protocol has no
    #: handshake, so whoever can connect speaks as ``lm_engine_id`` for ``lm_tenants``
    lm_host: str = "127.0.0.1"
    lm_port: int = Field(default=-1, ge=-1, le=65535)
    #: the engine identity the listener stands for (required when it is on): the policy must
    #: name it in a tenant's ``engines`` (``"*"`` does not admit it)
    lm_engine_id: str = Field(default="", max_length=128)
    #: the tenants the listener may serve (required when it is on); keys of any other tenant
    #: are denied before the policy is asked
    lm_tenants: list[str] = Field(default_factory=list)
    #: tenant assumed for ``lm://`` keys that carry no tenant tag (empty: such keys are denied);
    #: must be one of ``lm_tenants``. The kvgov wire never assumes one: an untagged key there is
    #: refused (``no_tenant``) before the policy sees it
    lm_default_tenant: str = ""
    #: engine tokens: ``{"token": "engine-id"}``. Empty in development accepts any engine id.
    engine_tokens: dict[str, SecretStr] = Field(default_factory=dict)
    #: a file holding the engine tokens in the same shape, as JSON (a mounted Secret; read at
    #: start-up, then followed: ``engine_tokens_reload_interval_s``): set this or
    #: ``engine_tokens``, not both
    engine_tokens_file: Path | None = None
    #: seconds between a running sidecar's checks of ``engine_tokens_file``: on a change it
    #: takes the new tokens and closes the connections of removed ones (a revoked token stops
    #: working within this); 0: never (a change then needs a restart)
    engine_tokens_reload_interval_s: float = Field(default=10.0, ge=0.0, le=3600.0)
    max_frame_bytes: int = Field(default=256 * _MIB, ge=_MIB)
    #: open data-plane connections, all listeners together (kvgov wire and lm://); more are
    #: closed at once (``docs/operations.md``, "Limits")
    max_connections: int = Field(default=1024, ge=1)
    #: ... from one peer (TCP address; on the Unix socket, one uid)
    max_connections_per_peer: int = Field(default=512, ge=1)
    #: ... authenticated as one engine (checked at HELLO; lm:// is its one declared engine)
    max_connections_per_engine: int = Field(default=64, ge=1)
    #: keys (EXISTS, GET, REMOVE) or items (PUT) one kvgov wire frame may carry; a large frame
    #: is handled in slices that yield to other connections
    max_frame_items: int = Field(default=4096, ge=1, le=4096)
    #: seconds from connect to a completed HELLO
    hello_timeout_s: float = Field(default=10.0, gt=0.0, le=3600.0)
    #: seconds for a frame's bytes to arrive once its first byte did (a PUT's payload: once
    #: its buffers are taken; a stalled frame gives them back), and for a GET's hits to be
    #: taken by the reader
    frame_timeout_s: float = Field(default=30.0, gt=0.0, le=3600.0)
    #: denials recorded one ledger event each, per connection and second, and in all per
    #: second; the excess is summarised (one ``kv:denied`` event with ``attrs.suppressed``)
    denials_recorded_per_connection: int = Field(default=32, ge=1)
    denials_recorded_per_s: int = Field(default=256, ge=1)
    #: bytes of chunk buffers the pool may hold at once (backpressure beyond this)
    buffer_pool_bytes: int = Field(default=1024 * _MIB, ge=8 * _MIB)
    #: the share of the pool one engine may hold at once (its stalled or pipelined frames
    #: wait for its own buffers, not another engine's); the default leaves a 256 MiB frame
    #: room in the default 1 GiB pool
    buffer_pool_engine_share: float = Field(default=0.25, gt=0.0, le=1.0)
    crypto_threads: int = Field(default=2, ge=1, le=64)
    #: threads that write large replies to their sockets (each serves one reply at a time;
    #: replies beyond this many wait for a free one)
    send_threads: int = Field(default=4, ge=1, le=256)
    #: chunks up to this many bytes are sealed and opened on the event loop, segment by segment
    #: as their bytes arrive or leave, instead of in the crypto threads. Unset: every size when
    #: the sidecar may use two CPUs or fewer (affinity and cgroup quota), where handing work to
    #: another thread only adds work; 1 MiB with more (the threads then run beside the loop)
    inline_crypto_bytes: int | None = Field(default=None, ge=0)
    #: what seals values: ``"unsafe-plaintext"`` stores them as they came (benchmarks only:
    #: refused in production and outside development)
    sealer: Literal["aes-256-gcm", "unsafe-plaintext"] = "aes-256-gcm"
    #: where the data plane's events go: ``"unsafe-null"`` records none (benchmarks only:
    #: refused in production and outside development)
    events: Literal["ledger", "unsafe-null"] = "ledger"

    @field_validator("engine_tokens")
    @classmethod
    def _engine_ids_named(cls, tokens: dict[str, SecretStr]) -> dict[str, SecretStr]:
        """Every token names an engine id a receipt cannot mistake for another engine's
        (:func:`kvgov.engine_ids.engine_id_problem`); the error names neither token nor id."""
        for token, engine in tokens.items():
            if not token:
                raise ValueError("an engine token is empty")
            problem = engine_id_problem(engine.get_secret_value())
            if problem is not None:
                raise ValueError(f"an engine id {problem} ({ENGINE_ID_RULE})")
        return tokens

    @field_validator("lm_engine_id")
    @classmethod
    def _lm_engine_id_text(cls, engine: str) -> str:
        problem = id_text_problem(engine) if engine else None  # empty: the listener is off
        if problem is not None:
            raise ValueError(f"the lm:// engine id {problem}")
        return engine

    @model_validator(mode="after")
    def _one_token_source(self) -> DataPlaneSettings:
        if self.engine_tokens and self.engine_tokens_file is not None:
            raise ValueError(
                "set dataplane.engine_tokens or dataplane.engine_tokens_file, not both"
            )
        return self

    def lm_problems(self) -> list[str]:
        """What is missing to turn the ``lm://`` listener on (in every environment)."""
        if self.lm_port < 0:
            return []
        problems = []
        if not self.lm_engine_id:
            problems.append(
                "dataplane.lm_engine_id must name the engine the lm:// listener stands for "
                "(the protocol has no handshake; list that id in your policy's tenant engines)"
            )
        if not self.lm_tenants:
            problems.append(
                "dataplane.lm_tenants must list the tenants the lm:// listener may serve"
            )
        if self.lm_default_tenant and self.lm_default_tenant not in self.lm_tenants:
            problems.append("dataplane.lm_default_tenant must be one of dataplane.lm_tenants")
        return problems


class ApiSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=7080, ge=0, le=65535)
    #: connections plus requests in progress the API server takes before answering 503
    limit_concurrency: int = Field(default=512, ge=1)
    #: seconds an idle keep-alive connection stays open
    timeout_keep_alive_s: float = Field(default=5.0, gt=0.0, le=600.0)
    #: seconds for a request (head and body) to arrive once begun; else it is closed
    request_timeout_s: float = Field(default=10.0, gt=0.0, le=600.0)
    #: seconds a response may wait for its peer to read any of it (a slow reader that keeps
    #: reading is not cut off); else the connection is reset and its slot freed
    response_timeout_s: float = Field(default=30.0, gt=0.0, le=600.0)
    #: connections one peer address may hold (0: no cap); beyond it a new one is reset.
    #: Behind an ingress or a proxy, each of its addresses is one peer
    max_connections_per_peer: int = Field(default=256, ge=0)
    #: bytes of a request head (request line and headers)
    max_header_bytes: int = Field(default=16 * 1024, ge=1024, le=1024 * 1024)
    #: bytes of a request body (413 beyond)
    max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    #: pending connections the kernel queues for the API port
    backlog: int = Field(default=256, ge=1)
    #: require bearer tokens on the REST API (refused off in production)
    auth: bool = True
    #: seconds a whole-ledger verification's report (``GET /v1/audit/verify``, the dashboard)
    #: is served again after it finished: one verification runs at a time per process, and
    #: callers in between get its report (``verified_at`` tells its age). 0: never served
    #: again (callers arriving while one runs still share it)
    verify_cache_s: float = Field(default=30.0, ge=0.0, le=3600.0)
    #: seconds a tenant-scoped caller is served the kept report, whatever
    #: ``verify_cache_s`` says, before it may start a fresh verification (fleet-wide
    #: readers refresh it sooner); caps what a scoped token can make the sidecar verify.
    #: 0: like every other caller
    verify_scoped_refresh_s: float = Field(default=600.0, ge=0.0, le=86400.0)
    #: serve ``/metrics`` without a token. Off: it needs an auditor or admin token that is not
    #: tenant-scoped (the counts move with every tenant's traffic). Its labels never name a
    #: tenant, user or key; open it only where the port is fenced off (a network policy)
    metrics_public: bool = False
    #: serve the OpenAPI document and its pages (``/openapi.json``, ``/docs``, ``/redoc``);
    #: unset: in development only
    docs: bool | None = None
    #: the reverse proxies (addresses or CIDR networks; ``"*"``: any peer) whose
    #: ``X-Forwarded-Proto`` and ``X-Forwarded-For`` are believed. Behind a TLS-terminating
    #: ingress, list its addresses: the dashboard then sees the scheme the browser used
    #: (its sign-in's origin check and its cookie depend on it)
    forwarded_allow_ips: list[str] = Field(default_factory=lambda: ["127.0.0.1", "::1"])
    #: mark the dashboard's session cookie ``Secure`` (sent over HTTPS only). Unset: always in
    #: production (a request a TLS proxy forwarded may reach kvgov as plain HTTP), elsewhere
    #: when the request came over HTTPS. ``false`` is refused in production
    secure_cookies: bool | None = None
    #: serve the API over TLS (1.2 or later) with this certificate (PEM, its chain after it)
    #: and its private key (PEM, unencrypted; 0600 and this process's user's own, like the
    #: other keys): both or neither. Read at start-up (a renewed certificate needs a restart).
    #: Unset, production refuses a host beyond loopback unless
    #: ``dataplane.cleartext_network_ok`` (``docs/api.md``, "TLS")
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    #: purge jobs a tenant may have open (pending or running, whoever asked for them) for a
    #: tenant-scoped admin token to create one more with ``POST /v1/purges``; beyond it 429
    #: with ``Retry-After``. Every job resets every pod's whole vLLM prefix cache (all tenants')
    #: and its steps are claimed before later jobs', other tenants' too (review r15, F2).
    #: Global admins and the CLI are not bound (``docs/api.md``, "Purge bounds")
    purges_open_per_tenant: int = Field(default=4, ge=1, le=10_000)
    #: purge jobs one tenant-scoped admin token may create in any 60 seconds (429 beyond)
    purges_per_minute_per_token: int = Field(default=10, ge=1, le=10_000)

    @model_validator(mode="after")
    def _tls_pair(self) -> ApiSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                "set both api.tls_cert_file and api.tls_key_file (the certificate and its"
                " private key), or neither"
            )
        return self

    @property
    def tls(self) -> bool:
        """Whether the API is served over TLS."""
        return self.tls_cert_file is not None


class PurgeSettings(_Section):
    #: vLLM engines whose GPU prefix cache is reset on purge (``POST {url}/reset_prefix_cache``)
    vllm_engines: list[str] = Field(default_factory=list)
    #: this sidecar's engines keep no GPU prefix cache (vLLM ``--no-enable-prefix-caching``):
    #: production then accepts no ``vllm_engines`` (else a purge would sign a receipt with no
    #: GPU reset while the engine's GPU may still hold the purged user's blocks)
    no_gpu_prefix_cache: bool = False
    engine_ack_timeout_s: float = Field(default=10.0, gt=0.0)
    http_timeout_s: float = Field(default=5.0, gt=0.0)
    #: a job not finished by every registered sidecar after this many seconds ends `incomplete`
    job_timeout_s: float = Field(default=300.0, gt=0.0)
    poll_interval_s: float = Field(default=1.0, gt=0.0)
    #: a step left ``running`` this long by a process that died is taken by another executor
    step_lease_s: float = Field(default=120.0, gt=0.0)
    #: a sidecar that reported within this many seconds gets its own purge steps
    sidecar_live_s: float = Field(default=60.0, gt=0.0)
    #: key digests of the EVICTs a sidecar owes engines its purges could not reach, held in
    #: memory (all engines together; ~120 bytes each) until their control channel is back;
    #: past it the oldest are dropped, logged and counted (0: none are kept)
    pending_evict_max_digests: int = Field(default=100_000, ge=0, le=10_000_000)
    #: an owed EVICT not delivered this many seconds after its step is dropped (logged, counted)
    pending_evict_ttl_s: float = Field(default=86_400.0, gt=0.0)


def _read_setting_file(name: str, path: Path) -> str:
    """The text of setting ``name``'s file, read now: a secret (engine tokens, a URL with its
    password, OPA's token), so a file others may read, or anyone but its owner (this process's
    user or root) may write, is refused (:func:`kvgov.privatefs.read_guarded_file`). An error
    names the file and its mode, never what it holds."""
    data = read_guarded_file(path, name, secret=True)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"cannot read {name} {path}: not UTF-8 text") from None


def _is_local_host(host: str | None) -> bool:
    """Whether a URL's host is this host: a loopback name or address (127.0.0.0/8, ::1), or
    the unspecified address (connecting to 0.0.0.0 or :: reaches this host too)."""
    if not host:
        return False
    name = host.lower().rstrip(".")
    if name in LOOPBACK_HOSTS or name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or address.is_unspecified


#: the shortest OPA token the production overlay's authz policy admits (opa-authz.rego)
OPA_TOKEN_MIN_CHARS = 32


def opa_token_problem(token: str) -> str | None:
    """Why the production OPA (``opa-authz.rego``) would refuse ``token`` for ever, or None: a
    sidecar started with it would deny every operation."""
    if len(token) < OPA_TOKEN_MIN_CHARS or any(ch.isspace() for ch in token):
        return (
            f"is not one the production OPA admits (at least {OPA_TOKEN_MIN_CHARS} characters,"
            " no whitespace): every decision would be refused; make one with"
            " `openssl rand -hex 32` (Secret kvgov-opa-token, docs/deploy.md)"
        )
    return None


class Settings(BaseSettings):
    """Every setting kvgov has. Built once at the edge and passed down explicitly."""

    model_config = SettingsConfigDict(
        env_prefix="KVGOV_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        validate_default=True,
        # a validation error's text would quote its input, whose URLs and tokens are secrets
        # (load_settings shows only each error's message; this covers Settings(...) itself)
        hide_input_in_errors=True,
    )

    environment: Environment = Environment.DEVELOPMENT
    data_dir: Path = Path(".kvgov")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_json: bool = True

    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    ledger: LedgerSettings = Field(default_factory=LedgerSettings)
    policy: PolicySettings = Field(default_factory=PolicySettings)
    keys: KeysSettings = Field(default_factory=KeysSettings)
    tiers: TierSettings = Field(default_factory=TierSettings)
    dataplane: DataPlaneSettings = Field(default_factory=DataPlaneSettings)
    api: ApiSettings = Field(default_factory=ApiSettings)
    purge: PurgeSettings = Field(default_factory=PurgeSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [
            init_settings,
            env_settings,
            _ShorthandSource(settings_cls),
        ]
        # the files last, each below what an operator says in the environment; the image's
        # defaults below the operator's file (sources merge section by section)
        for path in (_CONFIG_FILE.get(), _DEFAULTS_FILE.get()):
            if path is not None:
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)

    @model_validator(mode="after")
    def _unsafe_combinations(self) -> Settings:
        problems = self.dataplane.lm_problems() + self._filesystem_bound_problems()
        if problems:
            raise ValueError("; ".join(problems))
        if self.environment is Environment.PRODUCTION:
            problems = list(self.production_problems())
            if problems:
                raise ValueError("unsafe for production: " + "; ".join(problems))
        return self

    def _min_filesystem_bytes(self) -> int:
        """The least ``tiers.filesystem_max_bytes`` may be (review r18, finding 4): twice
        ``dataplane.buffer_pool_bytes``, and at least ``dataplane.max_frame_bytes``.

        Every put holds its pooled buffer (its sealed value, whole) until its file is in the
        tier's index, so the puts in flight hold up to the pool's bytes of the bound, counted
        in disk blocks (a 64 KiB buffer's file takes up to 68 KiB) and with the files evicted
        for them until removed; only what is left is room for cached entries. A bound near
        the pool has puts refused as "held by puts in progress" (the chain then removes the
        key from every tier) and evictions reaching the entries just written; twice the pool
        leaves at least about the pool's worth cached. A value is refused by a tier it would
        not fit, so a bound below the largest value a frame may carry caches such values
        nowhere."""
        dp = self.dataplane
        return max(2 * dp.buffer_pool_bytes, dp.max_frame_bytes)

    def _filesystem_bound_problems(self) -> list[str]:
        """A ``tiers.filesystem_max_bytes`` below :meth:`_min_filesystem_bytes` (in every
        environment: it breaks puts, it does not only weaken them); unchecked where the chain
        has no filesystem tier (nothing reads it)."""
        bound = self.tiers.filesystem_max_bytes
        if bound is None or "filesystem" not in self.tiers.chain:
            return []
        least = self._min_filesystem_bytes()
        if bound >= least:
            return []
        dp = self.dataplane
        problem = (
            f"tiers.filesystem_max_bytes={bound} is below {least}: it must be at least twice"
            f" dataplane.buffer_pool_bytes={dp.buffer_pool_bytes} (puts hold up to the pool's"
            " bytes of the tier until written; a bound near it refuses puts as held by puts in"
            " progress and evicts the values just written) and at least"
            f" dataplane.max_frame_bytes={dp.max_frame_bytes} (a larger value is cached"
            f" nowhere); set tiers.filesystem_max_bytes to at least {least} (and the tier's"
            " volume about 10% above it) or lower the pool or the frame size"
        )
        return [problem]

    def production_problems(self) -> list[str]:
        """What makes these settings unsafe outside development (empty when none)."""
        problems: list[str] = []
        if self.policy.engine == "unsafe-allow-all":
            problems.append("policy.engine=unsafe-allow-all allows every operation")
        if self.dataplane.sealer == "unsafe-plaintext":
            problems.append("dataplane.sealer=unsafe-plaintext stores values unencrypted")
        if self.dataplane.events == "unsafe-null":
            problems.append("dataplane.events=unsafe-null records nothing in the ledger")
        if not self.api.auth:
            problems.append("api.auth=false leaves the compliance API open")
        if self.api.secure_cookies is False:
            problems.append(
                "api.secure_cookies=false lets the dashboard's session cookie travel over "
                "plain HTTP"
            )
        purge = self.purge
        if not purge.vllm_engines and not purge.no_gpu_prefix_cache:
            problems.append(
                "purge.vllm_engines is empty: a purge would sign its receipt with no GPU prefix"
                " cache reset while the engine's GPU may still hold the purged user's blocks;"
                ' list the pod\'s vLLM (["http://127.0.0.1:8000"] in the shipped manifests), or'
                " set purge.no_gpu_prefix_cache=true for engines run without prefix caching"
            )
        elif purge.vllm_engines and purge.no_gpu_prefix_cache:
            problems.append(
                "purge.no_gpu_prefix_cache=true with purge.vllm_engines set: say one (engines"
                " without a GPU prefix cache need no reset)"
            )
        dp = self.dataplane
        if not dp.engine_tokens and dp.engine_tokens_file is None and not dp.unix_path:
            problems.append("no engine tokens: any process could act as an engine")
        if self.keys.kek_path is None:
            problems.append("keys.kek_path must point at a provisioned key-encryption key")
        url = self.database.url.get_secret_value()
        if url.startswith("sqlite") or not (url or self.database.url_file):
            problems.append("production needs a Postgres ledger (database.url or url_file)")
        problems += self._inline_transport_problems()
        if not self.database.runtime_role:
            problems.append(
                "database.runtime_role is empty: sidecars must connect as a role that does not"
                " own the ledger's tables (docs/database.md)"
            )
        if dp.host and dp.host not in LOOPBACK_HOSTS and not dp.cleartext_network_ok:
            problems.append(
                f"dataplane.host={dp.host} puts the kvgov wire, which has no encryption of its "
                "own, beyond this host (engine tokens and opened values in the clear): bind it "
                "to 127.0.0.1 or use dataplane.unix_path; behind a mesh that encrypts pod "
                "traffic (mTLS) set dataplane.cleartext_network_ok"
            )
        api = self.api
        if api.host not in LOOPBACK_HOSTS and not api.tls and not dp.cleartext_network_ok:
            problems.append(
                f"api.host={api.host} serves the REST API in plain HTTP beyond this host:"
                " bearer tokens, the dashboard's session cookie and every compliance answer"
                " (provenance, purge receipts) in the clear; set api.tls_cert_file and"
                " api.tls_key_file, or bind it to 127.0.0.1 behind a TLS-terminating proxy;"
                " behind a mesh that encrypts pod traffic (mTLS) set"
                " dataplane.cleartext_network_ok"
            )
        policy = self.policy
        if (
            policy.engine == "opa"
            and policy.opa_token_file is None
            and not (policy.opa_token and policy.opa_token.get_secret_value())
        ):
            problems.append(
                "policy.engine=opa without policy.opa_token or policy.opa_token_file: an OPA"
                " that kvgov can ask without a token serves every process that reaches it,"
                " and in a pod that is every container (vLLM's too): it reads the policy and"
                " its data (GET /v1/data), asks any decision and rewrites policies; start OPA"
                " with --authentication=token --authorization=basic and the system.authz"
                " policy of deploy/kubernetes/overlays/production/opa-authz.rego, and give"
                " kvgov the token (Secret kvgov-opa-token, docs/deploy.md)"
            )
        inline = policy.opa_token.get_secret_value() if policy.opa_token else ""
        if policy.engine == "opa" and inline and (problem := opa_token_problem(inline)):
            problems.append(f"policy.opa_token {problem}")
        if self.policy.engine == "opa":
            opa = urlsplit(self.policy.opa_url)
            if opa.scheme == "http":
                # whatever its host: a loopback one (in any spelling: 0x7f.1, the pod's own
                # name or address) is a port any container of the pod binds whenever OPA's
                # process is gone, and one beyond the pod is the token in the clear, answered
                # by whoever takes OPA's place; plain HTTP proves neither end (review r9)
                where = (
                    "a loopback TCP port, which any process of the host (in a pod: every"
                    " container, vLLM's too) can bind whenever OPA's process is gone (OOM,"
                    " crash, restart back-off): it then receives policy.opa_token with every"
                    " decision and answers them all"
                    if _is_local_host(opa.hostname)
                    else "plain HTTP: nothing proves who answers (a port of this pod's own"
                    " address, or any other spelling of this host, is as open as loopback), and"
                    " beyond the pod every decision and policy.opa_token cross in the clear"
                )
                problems.append(
                    f"policy.opa_url={opa.scheme}://{opa.hostname} asks OPA over {where}; run"
                    " OPA on a Unix socket in a volume only OPA and kvgov mount"
                    " (--addr=unix:///run/opa/opa.sock, policy.opa_url=unix:///run/opa/opa.sock)"
                    " or serve it over https:// (a mesh does not prove OPA to kvgov:"
                    " dataplane.cleartext_network_ok does not lift this)"
                )
        if dp.lm_port >= 0 and dp.lm_host not in LOOPBACK_HOSTS:
            problems.append(
                f"dataplane.lm_host={dp.lm_host} exposes the handshake-less lm:// listener "
                "beyond this host: bind it to 127.0.0.1 (the engine in the same pod)"
            )
        if "filesystem" in self.tiers.chain and self.tiers.filesystem_max_bytes is None:
            problems.append(
                "tiers.chain has filesystem and tiers.filesystem_max_bytes is unset: the tier"
                " would grow with every unique prompt until its volume is full, and a"
                " Kubernetes emptyDir past its sizeLimit gets the pod evicted at once, with the"
                " ledger journal's acknowledged events on the same pod; set the bound about"
                " 10% under the tier's volume (the shipped manifests: 16 GiB on an 18Gi"
                " emptyDir of its own, docs/deploy.md)"
            )
        return problems

    # -- derived paths ---------------------------------------------------------------------

    @property
    def database_url(self) -> str:
        """The runtime role's URL (``database.url`` or ``url_file``; else the SQLite default)."""
        db = self.database
        url = self._url(db.url, db.url_file, "database.url_file")
        return url or f"sqlite:///{(self.data_dir / 'ledger.db').as_posix()}"

    @property
    def migration_database_url(self) -> str:
        """The owner role's URL, for migrations (``database.migration_url`` or its file; else
        the runtime URL: one role for both)."""
        db = self.database
        url = self._url(db.migration_url, db.migration_url_file, "database.migration_url_file")
        return url or self.database_url

    @property
    def redis_url(self) -> str:
        """The Redis tier's URL (``tiers.redis_url`` or ``redis_url_file``, read now; else
        ``redis://127.0.0.1:6379/0``). It may hold a password: never log it."""
        tiers = self.tiers
        url = self._url(
            tiers.redis_url, tiers.redis_url_file, "tiers.redis_url_file", database=False
        )
        return url or _DEFAULT_REDIS_URL

    def _url(self, value: SecretStr, path: Path | None, name: str, *, database: bool = True) -> str:
        """A URL setting's value, or the content of its file (read now: a rotated Secret is
        picked up by the next process). Errors name the file, never what it holds. ``database``:
        a database URL (else the Redis tier's)."""
        if path is None:
            url = value.get_secret_value()
            where = name.removesuffix("_file")
        else:
            url = _read_setting_file(name, path).strip()
            where = f"{name} {path}"
            if not url:
                what = "the database URL" if database else "the Redis URL"
                raise ConfigError(f"{name} {path} is empty", hint=f"it must hold {what}")
            if database and self.environment is Environment.PRODUCTION and url.startswith("sqlite"):
                raise ConfigError(f"{name} {path} names SQLite: production needs a Postgres ledger")
        self._check_url(url, where, database=database)
        if url and self.environment is Environment.PRODUCTION:
            problem = self._transport_problem(where, url, database=database)
            if problem:
                raise ConfigError(problem)
        return url

    @staticmethod
    def _check_url(url: str, name: str, *, database: bool) -> None:
        """Refuse a URL whose password the driver would split (its tail taken for the host,
        then quoted in the connection error): the error names the setting, never the URL."""
        problem = url_password_problem(url) if url else None
        if problem:
            what = "database URL" if database else "Redis URL"
            raise ConfigError(f"{name}: the {what} is malformed: {problem}")

    def _inline_transport_problems(self) -> list[str]:
        """Production: the URLs given inline that reach beyond this host without verified TLS
        (those in files are checked when read, :meth:`_url`)."""
        db = self.database
        problems: list[str] = []
        for name, secret, database in (
            ("database.url", db.url, True),
            ("database.migration_url", db.migration_url, True),
            ("tiers.redis_url", self.tiers.redis_url, False),
        ):
            url = secret.get_secret_value()
            if not url or url_password_problem(url):
                continue  # unset; or malformed, which is refused (named) when it is read
            problem = self._transport_problem(name, url, database=database)
            if problem:
                problems.append(problem)
        return problems

    def _reach(self, url: str, *, database: bool) -> Reach | None:
        """Where ``url`` connects and whether it demands a verified server; None for a URL
        this check has nothing to say of (SQLite, refused in production on its own; a scheme
        :func:`kvgov.db.engine.make_engine` refuses)."""
        if not database:
            return redis_reach(url)
        if not url.startswith("postgresql"):
            return None
        return postgres_reach(url, os.environ)

    def _transport_problem(self, where: str, url: str, *, database: bool) -> str | None:
        """Why production refuses ``url`` (setting ``where``) for its transport, or None: it
        reaches beyond this host without TLS that proves the server, and the setting's mesh
        opt-out is off. Names the setting, the hosts and what to add; never the URL."""
        reach = self._reach(url, database=database)
        if reach is None or not reach.exposed:
            return None
        opt_out = "database.cleartext_network_ok" if database else _REDIS_OPT_OUT
        if reach.unreadable is not None:
            what = "sslmode=verify-full and sslrootcert" if database else "rediss://"
            return _scrubbed(
                f"{where}: cannot tell where the URL connects ({reach.unreadable}); production"
                f" needs one it can read, with {what} beyond this host",
                url,
            )
        if (
            self.database.cleartext_network_ok
            if database
            else self.tiers.redis_cleartext_network_ok
        ):
            return None
        hosts = ", ".join(reach.beyond)
        mesh = (
            "; behind a mesh that encrypts and authenticates the connection (mTLS) set"
            f" {opt_out} (kvgov then logs a warning at every start)"
        )
        if database:
            env = [n for n in ("PGSSLMODE", "PGSSLROOTCERT") if os.environ.get(n)]
            unseen = (
                f" ({' and '.join(env)} in the environment do not count: the URL itself must"
                " say it, as every process that reads it gets it)"
                if env
                else ""
            )
            why = (
                "libpq then trusts whatever ~/.postgresql/root.crt the connecting process has"
                if reach.lacks_ca
                else "libpq then does not prove the server (and unless sslmode is require,"
                " falls back to plaintext when whoever answers declines TLS), so whoever is on"
                " the path can answer in the database's place and keep the role's session"
            )
            text = (
                f"{where} connects to {hosts} with {reach.said}: {why}; add"
                f" ?{POSTGRES_CURE} to the URL ('&' if it has a query already; the CA that"
                ' issued the database server\'s certificate, docs/database.md, "TLS")'
                f"{unseen}, or reach the database on loopback or a Unix socket{mesh}"
            )
        else:
            text = (
                f"{where} connects to {hosts} with {reach.said}: the Redis password and the"
                " tier's traffic cross the network to whoever answers; use rediss:// (the"
                " server's certificate and name checked: leave ssl_cert_reqs and"
                " ssl_check_hostname at their defaults, ssl_ca_certs=<CA file> for a private"
                f" CA), or a Redis on loopback or unix://{mesh}"
            )
        return _scrubbed(text, url)

    def unverified_transports(self, *uses: TransportUse) -> list[UnverifiedTransport]:
        """Production: the URLs of ``uses`` (``runtime``: the sidecar's and the CLI's ledger
        URL; ``migration``: ``kvgov db upgrade``'s; ``redis``: the Redis tier's) that reach
        beyond this host without verified TLS because their mesh opt-out says so: what a
        start logs at WARNING. Reads the URL files (:class:`ConfigError` as when used)."""
        if self.environment is not Environment.PRODUCTION:
            return []
        db, tiers = self.database, self.tiers
        runtime = ("database.url", db.url, db.url_file)
        sources: dict[TransportUse, tuple[str, SecretStr, Path | None]] = {
            "runtime": runtime,
            "migration": (
                ("database.migration_url", db.migration_url, db.migration_url_file)
                if db.migration_url.get_secret_value() or db.migration_url_file
                else runtime
            ),
            "redis": ("tiers.redis_url", tiers.redis_url, tiers.redis_url_file),
        }
        found: list[UnverifiedTransport] = []
        for use in dict.fromkeys(uses):
            name, value, path = sources[use]
            database = use != "redis"
            url = self._url(value, path, f"{name}_file", database=database)
            reach = self._reach(url, database=database) if url else None
            if reach is not None and reach.exposed:
                setting = name if path is None else f"{name}_file"
                opt_out = "database.cleartext_network_ok" if database else _REDIS_OPT_OUT
                found.append(
                    UnverifiedTransport(
                        use, setting, _scrubbed(", ".join(reach.beyond), url), opt_out
                    )
                )
        return found

    @property
    def engine_tokens(self) -> dict[str, SecretStr]:
        """The engine tokens (``{"token": "engine-id"}``): ``dataplane.engine_tokens``, or the
        JSON object in ``dataplane.engine_tokens_file`` (read now), every entry of which must
        name a valid engine id (:mod:`kvgov.engine_ids`): start-up refuses a file with one
        that does not. Errors name the file and what is wrong with it, never a token."""
        tokens, refused = self.read_engine_tokens()
        if refused:
            raise ConfigError(
                f"dataplane.engine_tokens_file {self.dataplane.engine_tokens_file}:"
                f" {len(refused)} engine id(s) refused: {'; '.join(sorted(set(refused)))}",
                hint=f"an engine id is {ENGINE_ID_RULE}",
            )
        return tokens

    def read_engine_tokens(
        self, *, revoke_all: bool = False
    ) -> tuple[dict[str, SecretStr], list[str]]:
        """The engine tokens whose engine id is valid, and why each other entry was refused
        (its id's problem, never the token or the id). A running sidecar takes the valid ones
        of a changed file and keeps serving them (:meth:`kvgov.proxy.app.Sidecar`); start-up
        refuses any (:attr:`engine_tokens`). A file that does not read (not JSON: half
        written; not an object; an entry that is not a token naming a string) raises
        :class:`ConfigError` naming the file, and a running sidecar keeps the tokens in force.

        A well-formed object with no valid entry (``{}``, or only refused ids) is what an
        operator who removed the last token wrote: with ``revoke_all`` (a running sidecar,
        whose server remembers that tokens were configured and then admits nobody) it is read
        as no tokens, every one revoked (review r16, finding 3: the leaked token of a
        single-token fleet kept working); without (start-up) it raises, as an empty map there
        would leave a sidecar that had never been given a token."""
        dp = self.dataplane
        path = dp.engine_tokens_file
        if path is None:
            return dict(dp.engine_tokens), []  # checked when the settings were validated
        name = "dataplane.engine_tokens_file"
        text = _read_setting_file(name, path)
        hint = 'it must hold a JSON object {"<token>": "<engine-id>", ...}'
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            raise ConfigError(f"{name} {path} is not JSON", hint=hint) from None
        if not isinstance(data, dict) or not (data or revoke_all):
            raise ConfigError(f"{name} {path} holds no tokens", hint=hint)
        tokens: dict[str, SecretStr] = {}
        refused: list[str] = []
        for token, engine in data.items():
            if not token or not isinstance(engine, str) or not engine:
                raise ConfigError(
                    f"{name} {path}: every token must map to an engine id (a string)",
                    hint=hint,
                )
            if utf8(token) is None:  # a lone surrogate escape
                raise ConfigError(
                    f"{name} {path}: a token is not text (a lone surrogate)", hint=hint
                )
            problem = engine_id_problem(engine)
            if problem is not None:
                refused.append(f"an engine id {problem}")
                continue
            tokens[token] = SecretStr(engine)
        if not tokens and not revoke_all:
            raise ConfigError(
                f"{name} {path} holds no valid engine id: {'; '.join(sorted(set(refused)))}",
                hint=f"an engine id is {ENGINE_ID_RULE}",
            )
        return tokens, refused

    @property
    def opa_token(self) -> str | None:
        """The bearer token for OPA: ``policy.opa_token``, or the content of
        ``policy.opa_token_file`` (read now, surrounding whitespace dropped); None when neither
        is set. Errors name the file, never what it holds."""
        policy = self.policy
        path = policy.opa_token_file
        if path is None:
            token = policy.opa_token.get_secret_value() if policy.opa_token else ""
            return token or None
        return self.read_opa_token_file(path)

    def read_opa_token_file(self, path: Path) -> str:
        """The token in ``policy.opa_token_file`` (``path``), read now with every check of
        start-up: a running sidecar reads it again after a rotation
        (:mod:`kvgov.policy.opa_token`). Raises :class:`ConfigError` naming the file and what
        is wrong, never what it holds."""
        name = "policy.opa_token_file"
        token = _read_setting_file(name, path).strip()
        if not token:
            raise ConfigError(f"{name} {path} is empty", hint="it must hold OPA's bearer token")
        if any(ch.isspace() or not ch.isprintable() for ch in token):
            raise ConfigError(
                f"{name} {path}: the token holds whitespace or control characters",
                hint="one line, the token alone (an HTTP header cannot carry the rest)",
            )
        if self.environment == "production" and (problem := opa_token_problem(token)):
            raise ConfigError(f"{name} {path}: the token {problem}")
        return token

    @property
    def is_postgres(self) -> bool:
        return self.database_url.startswith("postgresql")

    @property
    def signing_key_path(self) -> Path:
        return self.ledger.signing_key_path or self.data_dir / "ledger-signing.key"

    @property
    def pseudonym_key_path(self) -> Path:
        return self.ledger.pseudonym_key_path or self.data_dir / "pseudonym.key"

    @property
    def journal_path(self) -> Path:
        return self.ledger.journal_dir or self.data_dir / "ledger-journal"

    @property
    def kek_path(self) -> Path:
        return self.keys.kek_path or self.data_dir / "kek.key"

    @property
    def filesystem_tier_path(self) -> Path:
        return self.tiers.filesystem_path or self.data_dir / "tiers" / "fs"

    @property
    def filesystem_tier_max_bytes(self) -> int:
        """``tiers.filesystem_max_bytes``, or (development, where it is unset)
        :data:`DEV_FILESYSTEM_MAX_BYTES`, raised to the least the data plane's settings allow
        (:meth:`_min_filesystem_bytes`: a large pool or frame size)."""
        bound = self.tiers.filesystem_max_bytes
        if bound is None:
            return max(DEV_FILESYSTEM_MAX_BYTES, self._min_filesystem_bytes())
        return bound

    @property
    def chain_id(self) -> str:
        if self.ledger.chain_id:
            return self.ledger.chain_id
        host = os.uname().nodename
        return f"{host}:{self.data_dir.resolve().as_posix()}"


_REDIS_OPT_OUT = "tiers.redis_cleartext_network_ok"
#: which connection :meth:`Settings.unverified_transports` is asked of
TransportUse = Literal["runtime", "migration", "redis"]


@dataclass(frozen=True)
class UnverifiedTransport:
    """A URL that reaches beyond this host without verified TLS under its mesh opt-out."""

    use: TransportUse
    #: the setting it came from (``database.url``, ``database.url_file`` ...)
    setting: str
    #: where it connects (host names and addresses, never the URL)
    hosts: str
    #: the opt-out that admits it
    opt_out: str


def _scrubbed(text: str, url: str) -> str:
    """``text`` with every piece of ``url``'s password that a driver could quote replaced."""
    for secret in url_secret_parts(url):
        text = text.replace(secret, "***")
    return text


class _ShorthandSource(PydanticBaseSettingsSource):
    """``KVGOV_DATABASE_URL`` is the documented way to pick Postgres; map it onto the model."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        url = os.environ.get("KVGOV_DATABASE_URL")
        return {"database": {"url": url}} if url else {}


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build and validate settings from, lowest priority first, the embedded defaults, the
    defaults file ``KVGOV_DEFAULTS_FILE`` names (the image's), a TOML file (``--config``), the
    environment and ``overrides``.

    Raises :class:`ConfigError` listing every problem; callers stop startup on it.
    """
    if config_file is not None and not config_file.is_file():
        raise ConfigError(f"config file not found: {config_file}")
    defaults_file = _defaults_file()
    unknown = _unknown_env_names()
    if unknown:
        hint = "KVGOV_ variables name a setting, nested with '__' (KVGOV_TIERS__CHAIN)"
        if any(_SERVICE_LINK.search(name) for name in unknown):
            hint += (
                "; names ending _SERVICE_HOST, _SERVICE_PORT or _PORT_<n>_TCP are what the"
                " kubelet makes of a Service named kvgov-*: set enableServiceLinks: false in"
                " the pod spec (the shipped manifests do)"
            )
        raise ConfigError(
            "unknown settings in the environment: " + ", ".join(sorted(unknown)), hint=hint
        )
    token = _CONFIG_FILE.set(config_file)
    defaults_token = _DEFAULTS_FILE.set(defaults_file)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        lines = [f"  {error_location(err['loc'])}: {err['msg']}" for err in exc.errors()]
        raise ConfigError("invalid settings:\n" + "\n".join(lines)) from None
    except SettingsError as exc:  # a value that is not JSON where JSON is expected: no value
        raise ConfigError(f"invalid settings: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {config_file} is not valid TOML: {exc}") from exc
    finally:
        _DEFAULTS_FILE.reset(defaults_token)
        _CONFIG_FILE.reset(token)


def _defaults_file() -> Path | None:
    """The defaults file ``KVGOV_DEFAULTS_FILE`` names (unset or empty: none), checked: one that
    is gone (a volume mounted over it) or not TOML stops start-up rather than leave the
    embedded defaults (``./.kvgov``, the API's port) in its place."""
    name = os.environ.get(DEFAULTS_FILE_ENV, "")
    if not name:
        return None
    path = Path(name)
    if not path.is_file():
        raise ConfigError(
            f"defaults file not found: {path} ({DEFAULTS_FILE_ENV})",
            hint="the image ships it; unset or empty the variable to go without",
        )
    try:
        tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"defaults file {path} cannot be read: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"defaults file {path} is not valid TOML: {exc}") from exc
    return path


#: settings whose keys are secrets (``{"<token>": "<engine-id>"}``): an error below one names
#: the setting, never the key
_SECRET_KEYED = frozenset({"engine_tokens"})


def error_location(loc: tuple[int | str, ...]) -> str:
    """A validation error's location as ``section.setting``, with what lies below a setting
    whose keys are secrets (an engine token) redacted: ``dataplane.engine_tokens[<redacted>]``."""
    parts: list[str] = []
    for part in loc:
        parts.append(str(part))
        if part in _SECRET_KEYED and len(parts) < len(loc):
            return ".".join(parts) + "[<redacted>]"
    return ".".join(parts) or "<root>"


#: query parameters of a URL whose value is a secret (libpq's ``password``, ``sslpassword``;
#: anything named like one): masked and scrubbed like the password in its userinfo
_SECRET_PARAM = re.compile(r"(?i)(pass|secret|token)")
_QUERY_PARAM = re.compile(r"([?&;])([^=&;#]*)=([^&;#]*)")


def _secret_param(name: str, value: str) -> bool:
    """A query parameter whose value is a secret (its name, percent-decoded, says so)."""
    return bool(value) and _SECRET_PARAM.search(unquote_plus(name)) is not None


def _query_secrets(url: str) -> list[str]:
    """The values of ``url``'s query parameters that are secrets (raw and percent-decoded)."""
    found: list[str] = []
    query = "?" + url.partition("?")[2] if "?" in url else ""
    for _, name, value in _QUERY_PARAM.findall(query):
        if _secret_param(name, value):
            found += [value, unquote_plus(value)]
    return found


def mask_url(url: str) -> str:
    """``url`` safe to show: everything between the user name and the last ``@`` (the password,
    whatever it holds, an unescaped ``@`` or ``/`` included), and the value of every query
    parameter that is a secret (``?password=...``, which libpq and SQLAlchemy accept too),
    shown as ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<not a URL>"
    if "@" in rest:
        userinfo, _, host = rest.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        user = user.partition("/")[0].partition("?")[0]
        rest = f"{user}{':***' if colon else ''}@{host}"
    return f"{scheme}://" + _QUERY_PARAM.sub(_masked_param, rest)


def _masked_param(m: re.Match[str]) -> str:
    lead, name, value = m.groups()
    return f"{lead}{name}=***" if _secret_param(name, value) else m[0]


def url_secret_parts(url: str) -> list[str]:
    """The pieces of ``url``'s password a driver may quote on its own (it split the password at
    an unescaped ``@``, ``/``, ``:`` or ``?``), longest first: what an error message about the
    URL must not show."""
    _scheme, sep, rest = url.partition("://")
    userinfo = rest.rpartition("@")[0] if sep else ""
    password = userinfo.partition(":")[2]
    parts = set(_query_secrets(url))
    if password:
        parts |= {password, *re.split(r"[@/:?#]", password)}
    return sorted((p for p in parts if len(p) >= 3), key=len, reverse=True)


def url_password_problem(url: str) -> str | None:
    """Why ``url`` cannot mean what it says (a password with an unescaped ``@``: the driver
    would take its tail for the host), else None. Never quotes the URL."""
    _scheme, sep, rest = url.partition("://")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0] if sep else ""
    if authority.count("@") < 2:
        return None
    return (
        "its password holds an unescaped '@' (the driver would take part of it for the host):"
        " percent-encode it ('@' as %40)"
    )


#: a Kubernetes service-link variable's tail (``<SERVICE>_SERVICE_HOST``, ``_PORT_7080_TCP``...)
_SERVICE_LINK = re.compile(r"_SERVICE_(HOST|PORT)|_PORT(_\d+_(TCP|UDP|SCTP)(_\w+)?)?$")


def _unknown_env_names() -> list[str]:
    """``KVGOV_*`` variables that name no setting: a typo there must not be silently ignored."""
    unknown = []
    for name in os.environ:
        if not name.startswith("KVGOV_") or name in ("KVGOV_DATABASE_URL", DEFAULTS_FILE_ENV):
            continue
        if name.startswith("KVGOV_TEST_"):  # the test suite's own knobs
            continue
        parts = name[len("KVGOV_") :].lower().split("__")
        model: type[BaseModel] = Settings
        for i, part in enumerate(parts):
            field_info = model.model_fields.get(part)
            if field_info is None:
                unknown.append(name)
                break
            annotation = field_info.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                model = annotation
            elif i < len(parts) - 1 and not _is_mapping(annotation):
                unknown.append(name)
                break
            else:
                break
    return unknown


def _is_mapping(annotation: object) -> bool:
    return getattr(annotation, "__origin__", None) is dict
