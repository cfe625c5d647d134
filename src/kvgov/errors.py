"""One error tree for kvgov.

Domain code raises these; only the edges (CLI entry point, API exception handlers, the wire
protocol's error replies) turn them into exit codes, HTTP statuses or error frames.
Every error has a human ``diagnostics()`` that is safe to show and to log: it never includes
key material, KV bytes, tokens or raw user ids.
"""

from __future__ import annotations


class KvgovError(Exception):
    """Base of every error kvgov raises on purpose."""

    #: short machine-readable code used in API problem details, wire error frames and logs
    code: str = "kvgov_error"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def diagnostics(self) -> str:
        """A human explanation, with a hint on what to do where one is known."""
        if self.hint:
            return f"{self.message}\n  hint: {self.hint}"
        return self.message


class ConfigError(KvgovError):
    """Settings are invalid or unsafe; startup must stop."""

    code = "config_error"


class StartupError(KvgovError):
    """A configured component could not be built (missing file, adapter failed to load...)."""

    code = "startup_error"


class LedgerError(KvgovError):
    """The ledger could not record or read something."""

    code = "ledger_error"


class LedgerBackpressureError(LedgerError):
    """The ledger writer's queue is full; the caller must wait or refuse the operation."""

    code = "ledger_backpressure"


class LedgerSealError(LedgerError):
    """A live writer could not write a seal of its own (a foreign seal, a resumed open): its
    own failure to retry and alert on, never a refusal of the events it was about to write."""

    code = "ledger_seal"


class SealScanCappedError(LedgerError):
    """A chain's seals could not be read within their bound: more rows that do not verify than
    one read examines (someone with the runtime database role inserted junk into
    ``chain_seals``: :mod:`kvgov.ledger.seals.scan`). Nothing that needs the chain's seals can
    be judged meanwhile, so it is refused (fail closed), never judged on part of them."""

    code = "ledger_seals_capped"


class IntegrityError(LedgerError):
    """The ledger's hash chain or a checkpoint signature does not verify."""

    code = "ledger_integrity"


class PolicyError(KvgovError):
    """A policy could not be loaded or evaluated (evaluation errors are denials, not raises)."""

    code = "policy_error"


class KeyManagementError(KvgovError):
    """Base for key-management errors (named so as not to shadow the builtin ``KeyError``)."""

    code = "key_error"


class KeyDestroyedError(KeyManagementError):
    """The data key needed to open a block was shredded: the data is unrecoverable by design."""

    code = "key_destroyed"


class KeyNotFoundError(KeyManagementError):
    """No data key with that id or version exists."""

    code = "key_not_found"


class CorruptValueError(KvgovError):
    """A value stored in a tier failed its checks at read: its envelope does not parse, its
    length or item metadata disagree with what was sealed, or it does not authenticate. It can
    never be served: the data plane answers a miss, records it and drops the entry."""

    code = "corrupt_value"


class SealError(CorruptValueError):
    """A sealed block failed to open: tampered, truncated, reordered, or bound to another key."""

    code = "seal_error"


class SealVersionError(SealError):
    """A stored value is in a sealed or envelope format this kvgov does not read (e.g. the
    unauthenticated envelope of format 1): refused, never trusted."""

    code = "seal_version"


class ItemMetaError(KvgovError):
    """A put item's metadata (fmt, dtype, shape, location, extra fields) is not one kvgov
    stores: the item is refused (``bad_item_meta``); the frame's other items are not."""

    code = "bad_item_meta"


class TierError(KvgovError):
    """A storage tier failed."""

    code = "tier_error"


class ProtocolError(KvgovError):
    """A malformed, oversize or unexpected frame on the wire."""

    code = "protocol_error"


class AuthError(KvgovError):
    """Missing or invalid credentials."""

    code = "unauthenticated"


class ForbiddenError(KvgovError):
    """Valid credentials without the right role or tenant."""

    code = "forbidden"


class NotFoundError(KvgovError):
    """The requested object does not exist."""

    code = "not_found"


class AmbiguousRequestError(KvgovError):
    """A request id that several tenants used, asked for without a tenant (request ids are
    scoped by tenant); the API answers 409, the CLI exits 2 asking for ``--tenant``."""

    code = "ambiguous_request"

    def __init__(self, message: str, *, tenants: tuple[str | None, ...] = ()) -> None:
        super().__init__(message)
        #: the tenants that used the id (None: requests that carried no tenant)
        self.tenants = tenants


class InvalidInputError(KvgovError):
    """Input well-formed for its schema but invalid (a bad cursor, a missing companion
    parameter, a retention period out of range); the API answers 422."""

    code = "invalid_input"


class UnknownSubjectError(KvgovError):
    """A user purge asked over the API for an id the ledger never saw act in the tenant (most
    likely misspelt: its purge would find nothing), without ``force``; the API answers 409."""

    code = "unknown_subject"


class RateLimitedError(KvgovError):
    """Too many of one caller's (or one tenant's) requests open or made just now; the API
    answers 429 with ``Retry-After: retry_after_s``."""

    code = "rate_limited"

    def __init__(self, message: str, *, retry_after_s: int, limit: str = "") -> None:
        super().__init__(message)
        #: whole seconds after which the request may succeed (at least 1)
        self.retry_after_s = max(1, retry_after_s)
        #: which bound refused it (a fixed word: a metric's label)
        self.limit = limit


class PurgeError(KvgovError):
    """A purge could not complete."""

    code = "purge_error"
