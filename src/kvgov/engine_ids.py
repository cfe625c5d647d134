"""What an engine id may be: the name a receipt, the ledger and the policy give an engine.

An engine id enters from the operator's token map (``dataplane.engine_tokens``, or the file
``dataplane.engine_tokens_file`` a running sidecar reads again), from a HELLO where no tokens
are configured (a local peer, development), and as ``dataplane.lm_engine_id``. A purge
receipt's ``engines`` step names a kvgov-wire engine by its bare id and the ``lm://``
listener's engine as ``lm:<id>`` (:data:`LM_PREFIX`): a wire engine named ``lm:10.0.0.5``
would read there like the ``lm://`` engine (which has no control channel and is never sent
EVICT), and an id with control, format or separator characters (a newline, a zero-width or a
bidi override) or surrounding blanks could pass for another engine in a receipt, a log line or
the dashboard. So could a look-alike that no normalisation folds (a Cyrillic ``м`` for ``m``, a
ratio sign for the colon: review r14), so an id is printable ASCII: no confusable of another
id's letters can enter. :func:`engine_id_problem` refuses those wherever an id enters.
"""

from __future__ import annotations

import unicodedata

#: the longest engine id (the ledger's ``principal`` column holds ``engine:`` and this)
ENGINE_ID_MAX = 128
#: how a receipt and the ledger's principals name the ``lm://`` listener's engine: a wire
#: engine's id never begins with it (in any case or compatibility form)
LM_PREFIX = "lm:"


def id_text_problem(engine: object) -> str | None:
    """Why ``engine`` is not a well-formed id (empty, too long, not printable ASCII or with
    surrounding blanks), or None. Never quotes the id: the answer goes in errors and logs."""
    if not isinstance(engine, str) or not engine:
        return "is empty"
    if len(engine) > ENGINE_ID_MAX:
        return f"is longer than {ENGINE_ID_MAX} characters"
    # isprintable() is False for every control (Cc), format (Cf: zero-width, bidi overrides),
    # surrogate (Cs), private-use (Co), line or paragraph separator (Zl, Zp) and
    # space but U+0020 (Zs)
    if not engine.isprintable():
        return "holds a control, format, separator or surrogate character"
    if engine != engine.strip():
        return "begins or ends with a blank"
    if not engine.isascii():
        # printable letters of other scripts read like ASCII ones (Cyrillic, Greek, fullwidth,
        # math symbols): an id that could pass for another is refused, not folded
        return "holds a character outside printable ASCII (it could read like another id)"
    return None


def engine_id_problem(engine: object) -> str | None:
    """Why ``engine`` may not name a kvgov-wire engine, or None: :func:`id_text_problem`, or
    it begins with :data:`LM_PREFIX` (NFKC-folded, any case), which names the ``lm://``
    engine in receipts."""
    problem = id_text_problem(engine)
    if problem is not None:
        return problem
    assert isinstance(engine, str)
    if unicodedata.normalize("NFKC", engine).casefold().startswith(LM_PREFIX):
        return f'begins with "{LM_PREFIX}", which names the lm:// listener\'s engine in receipts'
    return None
