"""The provenance ledger: schema, hash chain, checkpoints and the batched writer."""
