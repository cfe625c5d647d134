"""An engine id that reads like the ``lm://`` engine's ``lm:<id>`` in a receipt is refused
(review r14, F4: these passed :func:`kvgov.engine_ids.engine_id_problem` before ids were held
to printable ASCII).

The check folds NFKC and case, so it catches compatibility forms (fullwidth letters, the
small roman numeral fifty U+217C), but not confusables that NFKC leaves apart: a Cyrillic small
em (U+043C) or palochka (U+04CF), or a ratio (U+2236) for the colon. Each id below is
printable, and a receipt, a log line or the dashboard shows it as ``lm:10.0.0.5``. Plain
ASCII ids, the ones operators write, still pass.
"""

from __future__ import annotations

import pytest

from kvgov.engine_ids import engine_id_problem

LOOKALIKES = [
    "l\u043c:10.0.0.5",  # Cyrillic small em
    "\u04cfm:10.0.0.5",  # Cyrillic small palochka
    "lm\u223610.0.0.5",  # ratio
]


@pytest.mark.parametrize("engine", LOOKALIKES, ids=["cyrillic-em", "palochka", "ratio"])
def test_an_engine_id_that_reads_like_the_lm_engine_is_refused(engine: str) -> None:
    assert engine_id_problem(engine) is not None, (
        f"engine id {engine!r} reads as 'lm:10.0.0.5' (the lm:// engine) and is accepted"
    )


@pytest.mark.parametrize("engine", ["vllm-acme", "engine_7", "pool/a.b@zone:1"])
def test_plain_ascii_engine_ids_pass(engine: str) -> None:
    assert engine_id_problem(engine) is None
