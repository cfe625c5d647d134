"""Connectors: where kvgov meets storage and engines.

``kvgov.connectors.tiers`` holds the sidecar's tier backends (memory, filesystem, Redis) and the
:class:`~kvgov.connectors.tiers.chain.TierChain` that composes them; ``kvgov.connectors.lmcache``
is the engine-side LMCache plugin (the ``lmcache`` extra). Nothing is imported here eagerly.
"""
