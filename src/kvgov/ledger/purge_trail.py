"""A purge's chained step events, read back for its receipt.

Each purge step that ran chains a ``purge:step`` event: ``attrs`` names the purge, the step and
its sidecar and carries the step detail's ``summary()``; ``reason`` is the state the step ended
in. Those are the facts ``kvgov audit verify`` proves untampered, unlike the mutable
``purge_steps`` rows the runtime database role may UPDATE, so the receipt is checked against
them (:mod:`kvgov.services.purge.trail`). The rows are read the way verification reads them, and
a row whose own hash does not cover its columns is ignored: it proves nothing. Nor does a row on
a chain no trusted key vouches for: the runtime role may INSERT into ``chains`` and
``ledger_events``, and the chain hash is unkeyed, so it could register a chain of its own and
chain a matching event on it (review 6, F1). An event counts only on a chain whose key is
trusted (the receipt signer's own, ``ledger.trusted_keys``), whose genesis that key signed, and
at a position a writer session of that key covered (:mod:`kvgov.ledger.seals`): not one its
live writer named in a foreign seal (appended to its chain by someone else, found at the
writer's next batch, checkpoint or close). Linking to the rest of the chain, and events
appended after a live writer's latest head-reading transaction, stay ``audit verify``'s job.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Select, select
from sqlalchemy.orm import Session

from kvgov.db.models import Chain, LedgerEvent, table
from kvgov.db.purge_index import is_purge_step, purge_id_of
from kvgov.ledger.chain import link
from kvgov.ledger.seals import Standing, read_standing
from kvgov.ledger.verify import row_fields

#: a step of one job: its name and its sidecar (None: a global step)
StepKey = tuple[str, str | None]


@dataclass(frozen=True, slots=True)
class ChainedStep:
    """What the chain says one step did (its latest attempt's event)."""

    step: str
    sidecar_id: str | None
    #: the state the step ended in (the event's ``reason``)
    state: str | None
    summary: Mapping[str, Any] | None
    attempt: int
    chain_id: str
    seq: int


def _vouched(conn: Connection, chain_id: str, trusted: Collection[bytes]) -> Standing | None:
    """The standing of ``chain_id`` when a trusted key holds it and signed its genesis."""
    key = conn.execute(select(Chain.public_key).where(Chain.chain_id == chain_id)).scalar()
    if key is None or bytes(key) not in trusted:
        return None
    standing = read_standing(conn, chain_id, bytes(key))
    return standing if standing.vouched else None


def steps_query(purge_id: str, tenant: str) -> Select[Any]:
    """The ``purge:step`` events of purge ``purge_id`` in ``tenant``, oldest first: found
    through ``ix_ledger_events_purge_id`` (:mod:`kvgov.db.purge_index`), whose expression and
    predicate it names exactly. What the database compares is only a selection; the exact
    checks are :func:`chained_steps`'s, on the parsed row."""
    t = table(LedgerEvent)
    return (
        select(t)
        .where(
            purge_id_of(t.c.attrs) == purge_id,
            is_purge_step(t.c.kind),
            t.c.tenant == tenant,
        )
        .order_by(t.c.occurred_at, t.c.chain_id, t.c.seq)
    )


def chained_steps(
    session: Session, purge_id: str, tenant: str, trusted: Collection[bytes]
) -> dict[StepKey, ChainedStep]:
    """The latest chained ``purge:step`` event of each step of purge ``purge_id``, on chains
    ``trusted`` keys vouch for (see the module docstring).

    A step retried after its event was chained (its row could not be written) has several;
    the row holds the last attempt's detail, so the last attempt's event is the one to match.
    """
    conn = session.connection()
    chains: dict[str, Standing | None] = {}
    found: dict[StepKey, ChainedStep] = {}
    for row in session.execute(steps_query(purge_id, tenant)):
        attrs = row.attrs if isinstance(row.attrs, Mapping) else {}
        if attrs.get("purge_id") != purge_id or link(row_fields(row)) != row.hash:
            continue
        if row.chain_id not in chains:
            chains[row.chain_id] = _vouched(conn, row.chain_id, trusted)
        standing = chains[row.chain_id]
        if standing is None or not standing.covers(row.seq):
            continue  # a chain no trusted key vouches for, or written while none held it
        sidecar = attrs.get("sidecar_id")
        attempt = attrs.get("attempt")
        summary = attrs.get("summary")
        event = ChainedStep(
            step=str(attrs.get("step")),
            sidecar_id=sidecar if isinstance(sidecar, str) else None,
            state=row.reason,
            summary=summary if isinstance(summary, Mapping) else None,
            attempt=attempt if isinstance(attempt, int) else 0,
            chain_id=row.chain_id,
            seq=row.seq,
        )
        key = (event.step, event.sidecar_id)
        earlier = found.get(key)
        if earlier is None or event.attempt >= earlier.attempt:
            found[key] = event
    return found
