"""The public surface of :mod:`kvgov.ledger.seals` once it became a package: every name the
single module offered (its logger aside) is still importable from the package, and is the one
object its home module defines, not a copy."""

import inspect
import sys

import kvgov.ledger.seals as seals

#: the public names of ``kvgov/ledger/seals.py`` before the split, but its ``log``
SINGLE_MODULE = {
    "CLOCK_SKEW",
    "Claim",
    "DEFAULT_MAX_UNSIGNED_AGE",
    "FOREIGN_SEP",
    "Gap",
    "Range",
    "SEAL_ORIGIN",
    "Seal",
    "SealKind",
    "Standing",
    "WRITER_LOCK_CLASS",
    "adopt_legacy",
    "claim_chain",
    "close_session",
    "covered",
    "first_gap",
    "foreign_note",
    "foreign_ranges",
    "genesis_note",
    "keep_open",
    "new_session",
    "open_session",
    "read_seals",
    "read_standing",
    "resume",
    "session_end",
    "session_note",
    "sign_genesis",
    "standing",
    "subtract",
    "write_foreign_seal",
    "write_genesis",
    "write_session_seal",
}
#: names added since the split (review r13, F1: a writer session's span, for the purge receipt;
#: a neighbour session's lease: its id, the lease it signs, the one rule of what a session holds)
ADDED = {"Span", "MAX_LEASE_S", "neighbour_id", "session_lease", "span_of"}
#: the bounded reader of a chain's seals (junk rows the runtime role inserts: test_seal_flood)
ADDED |= {
    "MAX_INVALID",
    "OTHER_KEY",
    "SealScan",
    "judged",
    "read_every",
    "read_valid",
    "scans_capped",
}
HOMES = ("notes", "coverage", "scan", "store", "sessions")


def test_the_package_exports_what_the_module_did() -> None:
    assert set(seals.__all__) == SINGLE_MODULE | ADDED
    assert all(hasattr(seals, name) for name in SINGLE_MODULE | ADDED)


def test_each_function_and_class_is_its_home_modules_own() -> None:
    defined = {
        name: obj
        for name in SINGLE_MODULE | ADDED
        if inspect.isclass(obj := getattr(seals, name)) or inspect.isfunction(obj)
    }
    assert len(defined) > 20
    for name, obj in defined.items():
        home = obj.__module__
        assert home.rpartition(".")[2] in HOMES, (name, home)
        assert getattr(sys.modules[home], name) is obj
