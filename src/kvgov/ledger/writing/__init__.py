"""The parts of :class:`~kvgov.ledger.writer.LedgerWriter`, one module each.

- :mod:`.schedule`: scheduling by urgency (which queued events go into the next batch, and
  when: urgent at once, lazy after ``lazy_max_delay_ms``) and the batching loop that runs each
  batch through the two stages below.
- :mod:`.sequence`: sequencing (the chain head the next batch is chained on, seq and hashes).
- :mod:`.commit`: committing (the batch's transaction on Postgres or SQLite, with retries,
  isolation of refused events and recovery of a commit whose reply was lost).
- :mod:`.acks`: journal acknowledgement (a put acknowledged once its event is fsynced to the
  local journal; hand-over to the commit when the journal fails).
- :mod:`.replay`: start-up (register the chain, read its head and journal mark, read back the
  journal records the chain does not hold yet).
- :mod:`.stats`: the counters they share (:class:`WriterStats`).

``LedgerWriter`` composes them; nothing outside the ledger imports these modules.
"""
