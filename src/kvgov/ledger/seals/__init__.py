"""Chain seals: signed statements of a chain's life, so that only a key holder can start a chain
or write to one that its writer closed.

The runtime database role can INSERT into ``chains`` and ``ledger_events`` and the chain hash
is unkeyed, so the rows alone prove nothing about who wrote them: a chain registered under a
trusted node's public key, or events appended after its writer stopped, would link and hash
correctly. Seals (table ``chain_seals``, append-only) close both doors. Each is an Ed25519
signature by the chain's key over a note::

    kvgov.ledger.seal/v1 <chain_id>          kvgov.ledger.seal/v1 <chain_id>
    genesis                                  <open|close> <session>[ exclusive]
    key <base64 public key>                  <seq>
    created <chains.created_at>              <base64 head hash>
    first 1                                  time <signed_at>
    time <signed_at>

* **genesis** (one per chain, ``seq`` 0): the writer vouches for the chain's row (its id, key
  and creation time) when it registers the chain; a chain registered before seals existed is
  vouched for at its writer's next start (see :func:`adopt_legacy`). Verification fails a chain
  without a valid genesis (``no_genesis``), unless it is a *legacy* chain: one holding a valid
  checkpoint signed before any seal of it (no key holder ever wrote a seal for it, but one
  signed its head before this release);
* **open** (each writer start, a random ``session`` id): the head the session starts on (it
  signs over whatever a crashed predecessor left unsigned). ``exclusive``: the writer holds the
  chain alone (a sidecar holding its journal's lock), so every session opened before it is
  over, crashed or not;
* **close** (each clean writer close): the head the session leaves;
* **foreign** (a live writer that found rows it did not write:
  :mod:`kvgov.ledger.writing.foreign`): the positions ``first..last`` and the hash at
  ``last``; stored with ``seq`` = ``last`` and ``session`` = ``<session>@<first>`` (several
  per session)::

      kvgov.ledger.seal/v1 <chain_id>
      foreign <session>
      <first> <last>
      <base64 hash at last>
      time <signed_at>

An open's ``<session>`` is 32 random hex characters, or, for a *neighbour* session (a
``kvgov token``/``kvgov tenant`` command beside the chain's sidecar), ``n<lease>-<hex>``: the
note signs the lease (:func:`.notes.session_lease`).

A session covers the positions ``(open.seq, end]``, ``end`` being its close or the next
exclusive open after it (open-ended while neither exists: a live or crashed writer; a
neighbour session without a close only until its lease ends, then up to what a seal signed
within its lease proves was on the chain: :func:`.coverage.span_of`, the one rule). A legacy
chain's positions up to its first open are covered too. No session covers a position a valid
foreign seal names: the writer that signed it had already left out whatever another writer
session of the chain covered (a CLI command beside it), so nobody holding the key wrote it. An
event no session covers fails verification: ``foreign_append`` when a foreign seal names it,
``after_close`` otherwise (written while no writer held the chain open), whatever checkpoints
follow. Closes, opens, foreign seals and checkpoints all sign a head; events after the last of
them are the *unsigned tail*, normal between checkpoints, and a failure (``stale_unsigned``)
once older than a bound (:data:`DEFAULT_MAX_UNSIGNED_AGE`, measured from the later of the first
unsigned event's time and the chain's newest signature) or dated in the future.

The package, one purpose a module (each imports only the ones listed after it):

- :mod:`.sessions`: the writer's side: a session's open (with the chain's genesis, or a legacy
  chain's adoption), keeping it open, its close, the advisory lock a live writer holds on its
  chain (:class:`Claim`) and the operator's ``--adopt``;
- :mod:`.store`: the ``chain_seals`` rows: sign and store each kind, read them back, and a
  chain's :class:`Standing` from the database; and how a checkpoint row is keyed and stored
  (:func:`.store.write_checkpoint_row`, imported from there);
- :mod:`.scan`: reading a chain's seals at a bounded cost, the one reader of ``chain_seals``
  rows (:func:`read_valid`; :func:`read_every` for ``audit verify``): rows that cannot matter
  are not read, and a read that meets more than :data:`MAX_INVALID` rows that do not verify
  (junk the runtime role inserted) fails closed, loudly;
- :mod:`.coverage`: what valid seals say about a chain, without a database: the positions the
  sessions cover, each session's :class:`Span` (which heads were signed while it held them:
  what a purge receipt counts events by), the first gap, the signature checks behind
  :class:`Standing`, and the bounds on the unsigned tail;
- :mod:`.notes`: the seal kinds, the text each kind signs and :class:`Seal`, one row that checks
  its own signature (every check remembered: a row read again costs no second check).

Import from here: the names below are the package's public surface.
"""

from kvgov.ledger.seals.coverage import (
    CLOCK_SKEW,
    DEFAULT_MAX_UNSIGNED_AGE,
    Gap,
    Range,
    Span,
    Standing,
    covered,
    first_gap,
    foreign_ranges,
    judged,
    session_end,
    span_of,
    standing,
    subtract,
)
from kvgov.ledger.seals.notes import (
    FOREIGN_SEP,
    MAX_LEASE_S,
    OTHER_KEY,
    SEAL_ORIGIN,
    Seal,
    SealKind,
    foreign_note,
    genesis_note,
    neighbour_id,
    session_lease,
    session_note,
)
from kvgov.ledger.seals.scan import (
    MAX_INVALID,
    SealScan,
    read_every,
    read_valid,
    scans_capped,
)
from kvgov.ledger.seals.sessions import (
    WRITER_LOCK_CLASS,
    Claim,
    adopt_legacy,
    claim_chain,
    close_session,
    keep_open,
    new_session,
    open_session,
    resume,
    sign_genesis,
)
from kvgov.ledger.seals.store import (
    read_seals,
    read_standing,
    write_foreign_seal,
    write_genesis,
    write_session_seal,
)

__all__ = [
    "CLOCK_SKEW",
    "DEFAULT_MAX_UNSIGNED_AGE",
    "FOREIGN_SEP",
    "MAX_INVALID",
    "MAX_LEASE_S",
    "OTHER_KEY",
    "SEAL_ORIGIN",
    "WRITER_LOCK_CLASS",
    "Claim",
    "Gap",
    "Range",
    "Seal",
    "SealKind",
    "SealScan",
    "Span",
    "Standing",
    "adopt_legacy",
    "claim_chain",
    "close_session",
    "covered",
    "first_gap",
    "foreign_note",
    "foreign_ranges",
    "genesis_note",
    "judged",
    "keep_open",
    "neighbour_id",
    "new_session",
    "open_session",
    "read_every",
    "read_seals",
    "read_standing",
    "read_valid",
    "resume",
    "scans_capped",
    "session_end",
    "session_lease",
    "session_note",
    "sign_genesis",
    "span_of",
    "standing",
    "subtract",
    "write_foreign_seal",
    "write_genesis",
    "write_session_seal",
]
