"""Tier backends: where the sidecar keeps sealed chunks, and the chain that composes them.

See ``docs/tiers.md``. :mod:`~kvgov.connectors.tiers.base` is the interface; one module per
backend; :func:`~kvgov.connectors.tiers.factory.build_tiers` builds the configured chain.
The Redis backend imports ``redis`` only when one is built.
"""

from kvgov.connectors.tiers.base import (
    BytesLike,
    DestinationTooSmallError,
    EntryInfo,
    EvictListener,
    Tier,
    TierStats,
)
from kvgov.connectors.tiers.chain import ChainHit, TierChain
from kvgov.connectors.tiers.factory import REGISTRY, build_tiers
from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.connectors.tiers.memory import MemoryTier

__all__ = [
    "REGISTRY",
    "BytesLike",
    "ChainHit",
    "DestinationTooSmallError",
    "EntryInfo",
    "EvictListener",
    "FilesystemTier",
    "MemoryTier",
    "Tier",
    "TierChain",
    "TierStats",
    "build_tiers",
]
