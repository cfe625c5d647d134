"""The database below the evidence: engine, sessions, migrations, schema and repositories.

``engine`` builds engines and sessions and runs migrations; ``models`` is the one schema (one
SQLAlchemy metadata, one Alembic history: the ledger's tables and the rest reference each other,
e.g. cache entries name their tenant); the other modules are the repositories of tenants,
tokens, data keys, purge jobs, sidecars and dashboard sessions. Repositories take a
``Session`` and never commit: the edge (request, CLI command, executor) owns the transaction.
The ledger (``kvgov.ledger``: events, chain, journal, writer, verify) builds on this package.
"""
