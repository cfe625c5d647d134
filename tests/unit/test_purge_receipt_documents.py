"""Typed purge receipts sign exactly the bytes the dict-built receipts signed.

The goldens below were produced by the ``dict[str, Any]`` receipt builder this model replaced
(commit f05169a), from the same job views: a receipt built now must encode to the same canonical
bytes, and a receipt signed then must still verify and parse. Since step details are read through
their models, the views' details hold every key their executor writes (``executed_by``, ``tiers``,
``keys_forgotten``, ``digests_sent``, ``removed``...), keys the dict builder never read: the
goldens did not change.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import ValidationError

from kvgov.db.purge_views import JobView, StepName, StepView
from kvgov.services.purge.documents import Receipt
from kvgov.services.purge.receipts import (
    ReceiptFor,
    canonical,
    raw_public_key,
    sign_receipt,
    verify_receipt,
)
from kvgov.services.purge.service import build_receipt
from kvgov.types import PurgeKind, PurgeState

T = datetime(2026, 11, 20, 10, 0, 0, tzinfo=UTC)


def step(i, name, state, detail, sidecar=None):
    return StepView(
        id=i,
        name=name,
        sidecar_id=sidecar,
        state=state,
        attempts=1,
        detail=detail,
        started_at=T,
        finished_at=T,
    )


def job(kind, subject, steps):
    return JobView(
        id="p-1",
        kind=kind,
        tenant="acme",
        subject=subject,
        state=PurgeState.RUNNING,
        dry_run=False,
        requested_by="cli:root",
        created_at=T,
        updated_at=T,
        finished_at=None,
        result=None,
        steps=steps,
    )


full = job(
    PurgeKind.USER,
    "u:acme:abc",
    [
        step(
            1,
            StepName.TIERS,
            PurgeState.COMPLETED,
            {
                "deleted": {"memory": 2, "filesystem": 1},
                "entries_in_scope": 3,
                "newly_purged": 3,
                "verified": True,
                "executed_by": "sidecar:a",
                "tiers": ["memory", "filesystem"],
                "keys_forgotten": 1,
            },
            "a",
        ),
        step(
            2,
            StepName.TIERS,
            PurgeState.COMPLETED,
            {
                "deleted": {"memory": 1},
                "entries_in_scope": 2,
                "newly_purged": 1,
                "verified": True,
                "executed_by": "sidecar:b",
                "tiers": ["memory"],
                "keys_forgotten": 0,
            },
            "b",
        ),
        step(
            3,
            StepName.KEYS,
            PurgeState.COMPLETED,
            {
                "executed_by": "cli:root",
                "destroyed": [
                    {"key_id": "u:acme:abc", "version": 1},
                    {"key_id": "u:acme:abc", "version": 2},
                ],
            },
        ),
        step(
            4,
            StepName.ENGINES,
            PurgeState.COMPLETED,
            {
                "executed_by": "sidecar:a",
                "digests_sent": 3,
                "acknowledged": ["vllm-2", "vllm-1", "vllm-1"],
                "removed": {"vllm-1": 2, "vllm-2": 1},
                "unreachable": [],
            },
        ),
        step(
            5,
            StepName.GPU,
            PurgeState.COMPLETED,
            {
                "executed_by": "cli:root",
                "results": [{"engine": "http://e1", "ok": True, "status": 200, "error": None}],
            },
        ),
        step(
            6,
            StepName.LEDGER,
            PurgeState.COMPLETED,
            {
                "executed_by": "cli:root",
                "payloads_erased": 4,
                "users_erased": 1,
                "payload_event": {"chain_id": "c1", "seq": 10},
                "erasure_event": {"chain_id": "c1", "seq": 11},
                "checkpoint": {
                    "chain_id": "c1",
                    "seq": 11,
                    "head_hash": "ab" * 32,
                    "signature": "c2lnbmF0dXJl",
                },
            },
        ),
    ],
)
partial = job(
    PurgeKind.TENANT,
    None,
    [
        step(
            1,
            StepName.TIERS,
            PurgeState.INCOMPLETE,
            {
                "deleted": {"memory": 1},
                "entries_in_scope": 2,
                "newly_purged": 1,
                "verified": False,
                "reason": "entries still present after delete: {'memory': 1}",
                "executed_by": "sidecar:a",
                "tiers": ["memory"],
                "keys_forgotten": 0,
                "still_present": {"memory": 1},
            },
            "a",
        ),
        step(
            2,
            StepName.TIERS,
            PurgeState.FAILED,
            {"not_taken": True, "reason": "sidecar b did not report"},
            "b",
        ),
        step(3, StepName.KEYS, PurgeState.COMPLETED, {"executed_by": "cli", "destroyed": []}),
        step(
            4,
            StepName.ENGINES,
            PurgeState.INCOMPLETE,
            {
                "executed_by": "sidecar:a",
                "digests_sent": 2,
                "acknowledged": [],
                "removed": {},
                "unreachable": [
                    {"engine": "vllm-3", "acked": False, "removed": 0, "error": "timeout"}
                ],
                "reason": "no successful EVICT acknowledgement from vllm-3",
            },
        ),
        step(
            5,
            StepName.GPU,
            PurgeState.INCOMPLETE,
            {
                "executed_by": "cli",
                "results": [
                    {"engine": "http://e2", "ok": False, "status": None, "error": "refused"}
                ],
                "reason": "GPU prefix cache not reset on http://e2",
            },
        ),
    ],
)
failed = job(
    PurgeKind.USER,
    "u:acme:x",
    [
        step(1, StepName.TIERS, PurgeState.PENDING, {}, "a"),
        step(
            2,
            StepName.LEDGER,
            PurgeState.FAILED,
            {"error": "ledger unavailable"},  # what fail_step leaves
        ),
    ],
)
FINISHED = "2026-11-20T10:00:05+00:00"
KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))

GOLDEN = {
    "full": (
        '{"engines":{"acknowledged":["vllm-1","vllm-2"],"unreachable":[]},"entries_in_sco'
        'pe":3,"entries_purged":3,"finished_at":"2026-11-20T10:00:05+00:00","format":"kvg'
        'ov-purge-receipt/1","gpu_reset":[{"engine":"http://e1","error":null,"ok":true,"s'
        'tatus":200}],"incomplete":[],"keys_destroyed":[{"key_id":"u:acme:abc","version":'
        '1},{"key_id":"u:acme:abc","version":2}],"kind":"user","ledger":{"checkpoint":{"c'
        'hain_id":"c1","head_hash":"ababababababababababababababababababababababababababa'
        'bababababab","seq":11,"signature":"c2lnbmF0dXJl"},"erasure_event":{"chain_id":"c'
        '1","seq":11},"payload_event":{"chain_id":"c1","seq":10},"payloads_erased":4,"use'
        'rs_erased":1},"purge_id":"p-1","requested_at":"2026-11-20T10:00:00+00:00","reque'
        'sted_by":"cli:root","scope":{"rule":"entries of the tenant owned by, scoped to, '
        'or put by the subject","subject":"u:acme:abc","tenant":"acme"},"sidecars":["a","'
        'b"],"state":"completed","subject":"u:acme:abc","tenant":"acme","tiers":{"filesys'
        'tem":1,"memory":3},"tiers_verified_absent":true}'
    ),
    "partial": (
        '{"engines":{"acknowledged":[],"unreachable":[{"engine":"sidecar:b","error":"side'
        'car b did not report"},{"engine":"vllm-3","error":"timeout"}]},"entries_in_scope'
        '":2,"entries_purged":1,"finished_at":"2026-11-20T10:00:05+00:00","format":"kvgov'
        '-purge-receipt/1","gpu_reset":[{"engine":"http://e2","error":"refused","ok":fals'
        'e,"status":null}],"incomplete":["tiers@a: entries still present after delete: {\''
        'memory\': 1}","tiers@b: sidecar b did not report","engines: no successful EVICT a'
        'cknowledgement from vllm-3","gpu: GPU prefix cache not reset on http://e2","engi'
        'ne sidecar:b did not acknowledge: sidecar b did not report"],"keys_destroyed":[]'
        ',"kind":"tenant","ledger":{},"purge_id":"p-1","requested_at":"2026-11-20T10:00:0'
        '0+00:00","requested_by":"cli:root","scope":{"rule":"every entry of the tenant","'
        'subject":null,"tenant":"acme"},"sidecars":[],"state":"incomplete","subject":null'
        ',"tenant":"acme","tiers":{"memory":1},"tiers_verified_absent":false}'
    ),
    "failed": (
        '{"engines":{"acknowledged":[],"unreachable":[]},"entries_in_scope":0,"entries_pu'
        'rged":0,"finished_at":"2026-11-20T10:00:05+00:00","format":"kvgov-purge-receipt/'
        '1","gpu_reset":[],"incomplete":["tiers@a: did not complete","ledger: ledger unav'
        'ailable"],"keys_destroyed":[],"kind":"user","ledger":{"checkpoint":null,"erasure'
        '_event":null,"payload_event":null,"payloads_erased":0,"users_erased":0},"purge_i'
        'd":"p-1","requested_at":"2026-11-20T10:00:00+00:00","requested_by":"cli:root","s'
        'cope":{"rule":"entries of the tenant owned by, scoped to, or put by the subject"'
        ',"subject":"u:acme:x","tenant":"acme"},"sidecars":[],"state":"failed","subject":'
        '"u:acme:x","tenant":"acme","tiers":{},"tiers_verified_absent":false}'
    ),
}

SIGNED_BEFORE = (
    '{"receipt": {"engines": {"acknowledged": ["vllm-1", "vllm-2"], "unreachable": []'
    '}, "entries_in_scope": 3, "entries_purged": 3, "finished_at": "2026-11-20T10:00:'
    '05+00:00", "format": "kvgov-purge-receipt/1", "gpu_reset": [{"engine": "http://e'
    '1", "error": null, "ok": true, "status": 200}], "incomplete": [], "keys_destroye'
    'd": [{"key_id": "u:acme:abc", "version": 1}, {"key_id": "u:acme:abc", "version":'
    ' 2}], "kind": "user", "ledger": {"checkpoint": {"chain_id": "c1", "head_hash": "'
    'abababababababababababababababababababababababababababababababab", "seq": 11, "s'
    'ignature": "c2lnbmF0dXJl"}, "erasure_event": {"chain_id": "c1", "seq": 11}, "pay'
    'load_event": {"chain_id": "c1", "seq": 10}, "payloads_erased": 4, "users_erased"'
    ': 1}, "purge_id": "p-1", "requested_at": "2026-11-20T10:00:00+00:00", "requested'
    '_by": "cli:root", "scope": {"rule": "entries of the tenant owned by, scoped to, '
    'or put by the subject", "subject": "u:acme:abc", "tenant": "acme"}, "sidecars": '
    '["a", "b"], "state": "completed", "subject": "u:acme:abc", "tenant": "acme", "ti'
    'ers": {"filesystem": 1, "memory": 3}, "tiers_verified_absent": true}, "signature'
    '": {"alg": "Ed25519", "key_id": "56475aa75463474c0285df5dbf2bcab7", "public_key"'
    ': "A6EHv/POEL4dcN0Y50vAmWfk1jCbpQ1fHdyGZBJVMbg=", "value": "PxD/SQoTJWXctjjwjBSe'
    'xaGR8q5aRVvhNsiy6YmbtgwchkTS3fyaFUUheIaW5JB/5ZJajcQUkvATFv1pDy1lAw=="}}'
)

JOBS = {
    "full": (full, PurgeState.COMPLETED),
    "partial": (partial, PurgeState.INCOMPLETE),
    "failed": (failed, PurgeState.FAILED),
}


@pytest.mark.parametrize("name", sorted(JOBS))
def test_typed_receipt_encodes_to_the_bytes_the_dict_receipt_signed(name: str) -> None:
    job, state = JOBS[name]
    receipt = build_receipt(job, state, finished_at=FINISHED)
    assert isinstance(receipt, Receipt)
    assert canonical(receipt.document()).decode() == GOLDEN[name]


def test_a_receipt_signed_before_the_typed_model_still_verifies_and_parses() -> None:
    doc = json.loads(SIGNED_BEFORE)
    check = verify_receipt(doc, [raw_public_key(KEY.public_key())])
    assert (check.ok, check.state, check.purge_id) == (True, "completed", "p-1")
    parsed = Receipt.model_validate(doc["receipt"])
    assert parsed.document() == doc["receipt"]
    # and the typed builder signs it identically (Ed25519 signatures are deterministic)
    signed = sign_receipt(build_receipt(full, PurgeState.COMPLETED, finished_at=FINISHED), KEY)
    assert signed == doc


def test_a_receipt_is_frozen_and_refuses_unknown_fields() -> None:
    receipt = build_receipt(full, PurgeState.COMPLETED, finished_at=FINISHED)
    with pytest.raises(ValidationError):
        receipt.tenant = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        Receipt.model_validate({**receipt.document(), "extra": 1})


def test_a_tampered_typed_receipt_does_not_verify() -> None:
    signed = sign_receipt(build_receipt(full, PurgeState.COMPLETED, finished_at=FINISHED), KEY)
    signed["receipt"]["entries_purged"] = 2
    check = verify_receipt(signed, [raw_public_key(KEY.public_key())])
    assert (check.ok, check.reason) == (False, "signature does not match the receipt")


def test_a_receipt_verifies_for_its_own_purge_only() -> None:
    """A genuine receipt copied onto another job's row is not that job's receipt."""
    signed = sign_receipt(build_receipt(full, PurgeState.COMPLETED, finished_at=FINISHED), KEY)
    trusted = [raw_public_key(KEY.public_key())]
    body = signed["receipt"]
    own = ReceiptFor(body["purge_id"], body["kind"], body["tenant"], body["subject"])
    assert verify_receipt(signed, trusted, job=own).ok
    for other in (
        replace(own, purge_id="another-purge"),
        replace(own, tenant="globex"),
        replace(own, subject="someone-else"),
        replace(own, kind="tenant"),
    ):
        check = verify_receipt(signed, trusted, job=other)
        assert not check.ok and "the receipt of purge" in check.reason, other
