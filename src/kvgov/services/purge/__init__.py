"""The right-to-be-forgotten purge: one service behind ``kvgov purge`` and ``/v1/purges``.

A purge is a durable job in the ledger database (``purge_jobs``) made of steps
(``purge_steps``): delete the subject's entries from every sidecar tier and verify they are gone,
shred the subject's data keys, tell every connected engine to evict, reset configured vLLM GPU
prefix caches, then erase the subject's ledger payload, append the erasure event and issue a
signed receipt. Every executor (each sidecar's background task, or the CLI with ``--wait``)
claims steps with ``SELECT ... FOR UPDATE SKIP LOCKED``; every step is idempotent, so a crash
anywhere is repaired by running the remaining steps again. See ``docs/purge.md``.
"""
