"""What the CLI and the REST API share: purge, keys, provenance and tokens.

Each service composes the middle packages (``ledger``, ``keys``, ``db``, ``connectors``,
``policy``) and returns typed results; the edges (CLI command, API request) own the transaction
and choose exit codes and HTTP statuses. Nothing here imports the sidecar (``kvgov.proxy``).
"""
