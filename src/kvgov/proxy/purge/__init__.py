"""The sidecar's side of the purge: its background executor and tier wiring.

The purge itself (jobs, steps, receipts) is :mod:`kvgov.services.purge`, shared with the CLI.
"""
