"""The policy contract: what the data plane asks (:class:`PolicyInput`), what it gets back
(:class:`Decision`), and who answers (:class:`PolicyEngine`).

The input document that reaches Rego is exactly :meth:`PolicyInput.to_document` (documented in
``docs/policy.md``). User fields are pseudonyms (the same keyed HMAC for the key's ``user`` tag
and the acting user, so equality still works); raw user ids never reach policy or decision logs.

Engines never raise for a bad input or a broken policy backend: they return a deny whose first
reason says why (:class:`DenyReason`). Only loading policies at startup raises
:class:`kvgov.errors.PolicyError`.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Protocol

from kvgov.types import Operation, Scope, Sensitivity

#: the Rego package and rule every engine evaluates: ``data.kvgov.authz.decision``
POLICY_PACKAGE = "kvgov.authz"
DECISION_RULE = "decision"
#: where the data document (tenants, engines, class limits) lives: ``data.kvgov.config``
DATA_PATH = "kvgov.config"


class DenyReason(StrEnum):
    """Reasons kvgov itself adds (the Rego policy adds its own, e.g. ``tenant_mismatch``)."""

    INVALID_INPUT = "invalid_input"
    INVALID_DECISION = "invalid_decision"  # the policy answered something that is not a decision
    POLICY_ERROR = "policy_error"  # the embedded engine failed to evaluate
    OPA_TIMEOUT = "opa_timeout"
    OPA_UNAVAILABLE = "opa_unavailable"  # connection refused, reset, DNS...
    OPA_UNTRUSTED = "opa_untrusted"  # OPA's Unix socket is not shown to be OPA's (its uid)
    OPA_BAD_STATUS = "opa_bad_status"  # a non-200 reply
    OPA_UNDEFINED = "opa_undefined"  # HTTP 200 without ``result``
    OPA_INVALID_REPLY = "opa_invalid_reply"  # not JSON, or not an object
    #: ``policy.opa_token_file`` changed to something unusable (empty, unreadable, too short
    #: in production): nothing was sent, not the replaced token either
    OPA_TOKEN_INVALID = "opa_token_invalid"  # noqa: S105 - a reason, no secret
    NOT_RECORDED = "decision_not_recorded"  # an allow the ledger could not take


_OPERATIONS = frozenset(op.value for op in Operation)
_SCOPES = frozenset(scope.value for scope in Scope)
_INPUT_KEYS = frozenset({"operation", "tenant", "key", "actor", "request", "tier", "entry"})
_SUB_FIELDS: dict[str, tuple[str, ...]] = {
    "key": ("tenant", "user", "model"),
    "actor": ("user", "engine", "listener"),
    "request": ("id", "sensitivity"),
    "entry": ("owner", "scope_user", "sensitivity"),
}


@dataclass(frozen=True, slots=True)
class EntryFacts:
    """What the ledger recorded for an existing entry at put time (used by get/exists)."""

    owner: str | None = None
    scope_user: str | None = None
    sensitivity: Sensitivity | str | None = None


#: an entry's facts as the decision cache keys them: ``(owner, scope_user, sensitivity)``, the
#: fields of :class:`EntryFacts` in order (a plain tuple: hashed and compared in C, where the
#: dataclass's ``__hash__``/``__eq__`` are Python calls on every cached get)
EntryKey = tuple[str | None, str | None, Sensitivity | str | None]


@dataclass(frozen=True, slots=True)
class PolicyInput:
    """Identity of one KV operation. Hashable: the decision cache keys on it directly."""

    operation: Operation | str
    #: tenant of the engine connection / request (server-side identity, not the key's claim)
    tenant: str | None
    #: engine identity of the connection
    engine: str | None
    key_tenant: str | None = None
    key_user: str | None = None
    model: str | None = None
    actor_user: str | None = None
    request_id: str | None = None
    sensitivity: Sensitivity | str | None = None
    tier: str | None = None
    entry: EntryFacts | None = None
    #: the door the operation came through: ``kvgov`` (an authenticated engine connection) or
    #: ``lm`` (LMCache's handshake-less protocol, which ``"*"`` engine lists do not admit)
    listener: str | None = None
    #: structural problems found by :meth:`from_document` (the engine denies on any)
    problems: tuple[str, ...] = ()

    def cache_key(self, request_id: str | None) -> tuple[object, ...]:
        """What the decision cache keys this input on: every field, ``request_id`` as given
        (the cache passes the id, or whether there is one; ``policy/cache.py``). A tuple built
        from the fields, not a copy of the input: a cached decision is looked up on every
        operation. An :class:`EntryFacts` stands as its :data:`EntryKey` (equal exactly when
        the facts are). :meth:`CachingPolicyEngine.decide_cached_as
        <kvgov.policy.cache.CachingPolicyEngine.decide_cached_as>` builds the same tuple from
        the fields themselves."""
        entry: object = self.entry
        if isinstance(entry, EntryFacts):
            entry = (entry.owner, entry.scope_user, entry.sensitivity)
        return (
            self.operation,
            self.tenant,
            self.engine,
            self.key_tenant,
            self.key_user,
            self.model,
            self.actor_user,
            request_id,
            self.sensitivity,
            self.tier,
            entry,
            self.listener,
            self.problems,
        )

    def to_document(self) -> dict[str, Any]:
        """The Rego ``input`` document."""
        entry: object = self.entry  # anything may arrive at runtime; validation names it
        if isinstance(entry, EntryFacts):
            entry = {
                "owner": entry.owner,
                "scope_user": entry.scope_user,
                "sensitivity": _plain(entry.sensitivity),
            }
        return {
            "operation": _plain(self.operation),
            "tenant": self.tenant,
            "key": {"tenant": self.key_tenant, "user": self.key_user, "model": self.model},
            "actor": {"user": self.actor_user, "engine": self.engine, "listener": self.listener},
            "request": {"id": self.request_id, "sensitivity": _plain(self.sensitivity)},
            "tier": self.tier,
            "entry": entry,
        }

    def digest(self) -> str:
        """SHA-256 of the canonical JSON of :meth:`to_document` (hex): the input digest."""
        return document_digest(self.to_document())

    @classmethod
    def from_document(cls, doc: object) -> PolicyInput:
        """Build from a JSON input document (``kvgov policy eval``); never raises.

        A value of the wrong type is dropped and named in ``problems``, so the engine denies
        with ``invalid_input`` and the reason lists the field.
        """
        problems: list[str] = []
        if not isinstance(doc, Mapping):
            return cls(operation="", tenant=None, engine=None, problems=("document",))
        problems.extend(sorted(f"unknown:{k}" for k in doc if k not in _INPUT_KEYS))
        subs: dict[str, Mapping[str, Any]] = {}
        for name, fields in _SUB_FIELDS.items():
            value = doc.get(name)
            if value is None:
                subs[name] = {}
                continue
            if not isinstance(value, Mapping):
                problems.append(name)
                subs[name] = {}
                continue
            subs[name] = value
            problems.extend(f"unknown:{name}.{k}" for k in value if k not in fields)

        def text(value: object, where: str) -> str | None:
            if value is None or isinstance(value, str):
                return value
            problems.append(where)
            return None

        operation = doc.get("operation")
        if not isinstance(operation, str):
            problems.append("operation")
            operation = ""
        entry: EntryFacts | None = None
        if doc.get("entry") is not None and "entry" not in problems:
            e = subs["entry"]
            entry = EntryFacts(
                owner=text(e.get("owner"), "entry.owner"),
                scope_user=text(e.get("scope_user"), "entry.scope_user"),
                sensitivity=text(e.get("sensitivity"), "entry.sensitivity"),
            )
        key, actor, request = subs["key"], subs["actor"], subs["request"]
        inp = cls(
            operation=operation,
            tenant=text(doc.get("tenant"), "tenant"),
            engine=text(actor.get("engine"), "actor.engine"),
            key_tenant=text(key.get("tenant"), "key.tenant"),
            key_user=text(key.get("user"), "key.user"),
            model=text(key.get("model"), "key.model"),
            actor_user=text(actor.get("user"), "actor.user"),
            request_id=text(request.get("id"), "request.id"),
            sensitivity=text(request.get("sensitivity"), "request.sensitivity"),
            tier=text(doc.get("tier"), "tier"),
            entry=entry,
            listener=text(actor.get("listener"), "actor.listener"),
        )
        return replace(inp, problems=tuple(problems)) if problems else inp


def _plain(value: object) -> object:
    return value.value if isinstance(value, StrEnum) else value


def canonical_json(doc: Mapping[str, Any]) -> str:
    """The canonical JSON text of a document: sorted keys, no whitespace, UTF-8."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def document_digest(doc: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of a document's canonical JSON."""
    return text_digest(canonical_json(doc))


def safe_digest(inp: PolicyInput) -> str:
    """The input digest, even for an input that cannot be serialised (then of its repr)."""
    try:
        return document_digest(inp.to_document())
    except (TypeError, ValueError, AttributeError):
        return text_digest(repr(inp))


def validated_document(inp: PolicyInput) -> tuple[dict[str, Any] | None, tuple[str, ...]]:
    """``(document, ())`` for a well-formed input, else ``(None, deny reasons)``."""
    problems = input_problems(inp)
    if problems:
        return None, tuple(f"{DenyReason.INVALID_INPUT}:{p}" for p in problems)
    return inp.to_document(), ()


def input_problems(inp: PolicyInput) -> tuple[str, ...]:
    """What is wrong with an input before any engine sees it (empty when nothing).

    Checks types and the operation; whether the tenant exists, is enabled, and so on is the
    policy's business.
    """
    problems = list(inp.problems)
    op = inp.operation
    if not isinstance(op, str) or op not in _OPERATIONS:
        problems.append("operation")
    for name in (
        "tenant",
        "engine",
        "key_tenant",
        "key_user",
        "model",
        "actor_user",
        "request_id",
        "sensitivity",
        "tier",
        "listener",
    ):
        value = getattr(inp, name)
        if value is not None and not isinstance(value, str):
            problems.append(name)
    entry: object = inp.entry  # callers can hand anything over at runtime
    if entry is not None:
        if not isinstance(entry, EntryFacts):
            problems.append("entry")
        else:
            for name in ("owner", "scope_user", "sensitivity"):
                value = getattr(entry, name)
                if value is not None and not isinstance(value, str):
                    problems.append(f"entry.{name}")
    return tuple(dict.fromkeys(problems))


@dataclass(frozen=True, slots=True)
class PolicyRevision:
    """Which policies and which data answered: recorded with every decision."""

    policy: str
    data: str


def new_decision_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class Decision:
    """A structured policy answer, never just a boolean."""

    allowed: bool
    reasons: tuple[str, ...]
    #: tiers the operation may use (for a put: where to write; for a get: where to read)
    tiers: tuple[str, ...]
    #: maximum time to live for what a put stores (None where it does not apply)
    ttl_s: int | None
    scope: Scope | None
    policy_revision: str
    data_revision: str
    decision_id: str
    input_digest: str
    #: the effective sensitivity the policy decided on (record it on the entry at put)
    sensitivity: str | None = None
    #: True when served from the decision cache
    cached: bool = False
    operation: str | None = field(default=None, compare=False)

    @property
    def reason(self) -> str | None:
        return self.reasons[0] if self.reasons else None

    @classmethod
    def deny(
        cls,
        *reasons: str,
        revision: PolicyRevision,
        input_digest: str,
        operation: str | None = None,
    ) -> Decision:
        return cls(
            allowed=False,
            reasons=tuple(reasons),
            tiers=(),
            ttl_s=None,
            scope=None,
            policy_revision=revision.policy,
            data_revision=revision.data,
            decision_id=new_decision_id(),
            input_digest=input_digest,
            operation=operation,
        )

    @classmethod
    def from_result(
        cls,
        result: object,
        *,
        revision: PolicyRevision,
        input_digest: str,
        operation: str | None = None,
    ) -> Decision:
        """Turn the policy's ``decision`` object into a :class:`Decision`; anything malformed
        is a deny (``invalid_decision``)."""

        def bad(what: str) -> Decision:
            return cls.deny(
                f"{DenyReason.INVALID_DECISION}:{what}",
                revision=revision,
                input_digest=input_digest,
                operation=operation,
            )

        if not isinstance(result, Mapping):
            return bad("not_an_object")
        allowed = result.get("allowed")
        reasons = result.get("reasons", [])
        tiers = result.get("tiers", [])
        ttl_s = result.get("ttl_s")
        scope = result.get("scope")
        sensitivity = result.get("sensitivity")
        if not isinstance(allowed, bool):
            return bad("allowed")
        if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
            return bad("reasons")
        if not isinstance(tiers, list) or not all(isinstance(t, str) for t in tiers):
            return bad("tiers")
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, int)):
            return bad("ttl_s")
        if allowed and ttl_s is not None and ttl_s <= 0:
            # 0 would be stored without expiry (keep nothing is not keep for ever): deny
            return bad("ttl_s")
        if scope is not None and scope not in _SCOPES:
            return bad("scope")
        if sensitivity is not None and not isinstance(sensitivity, str):
            return bad("sensitivity")
        if not allowed and not reasons:
            reasons = ["denied"]
        return cls(
            allowed=allowed,
            reasons=tuple(reasons),
            tiers=tuple(tiers) if allowed else (),
            ttl_s=ttl_s if allowed else None,
            scope=Scope(scope) if allowed and scope is not None else None,
            policy_revision=revision.policy,
            data_revision=revision.data,
            decision_id=new_decision_id(),
            input_digest=input_digest,
            sensitivity=sensitivity,
            operation=operation,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (CLI output, ledger attrs)."""
        return {
            "allowed": self.allowed,
            "reasons": list(self.reasons),
            "tiers": list(self.tiers),
            "ttl_s": self.ttl_s,
            "scope": None if self.scope is None else self.scope.value,
            "sensitivity": self.sensitivity,
            "policy_revision": self.policy_revision,
            "data_revision": self.data_revision,
            "decision_id": self.decision_id,
            "input_digest": self.input_digest,
            "cached": self.cached,
        }


class PolicyEngine(Protocol):
    """Decides KV operations. Every engine fails closed: bad input, timeouts, transport errors
    and undefined results are denies with a reason, never exceptions.

    The data plane calls :meth:`decide_cached` first (synchronous; an engine without a cache
    returns None) and awaits :meth:`decide` when it gets None.
    """

    @property
    def revision(self) -> PolicyRevision:
        """Revision of the policies and data currently answering."""
        ...

    async def decide(self, inp: PolicyInput) -> Decision: ...

    def decide_cached(self, inp: PolicyInput) -> Decision | None:
        """A cached allow, or None (then await :meth:`decide`). Denies are never served here,
        so that every deny goes through :meth:`decide` and is recorded."""
        ...

    async def reload(self) -> PolicyRevision:
        """Reload policies and data from their sources; raises PolicyError when invalid (the
        old ones keep answering then)."""
        ...

    async def aclose(self) -> None: ...


class DecisionRecorder(Protocol):
    """Where decisions worth an audit record go (the data plane wires it to the ledger)."""

    async def record(self, inp: PolicyInput, decision: Decision) -> None:
        """Record one decision. Raises :class:`kvgov.errors.KvgovError` when it cannot."""
        ...
