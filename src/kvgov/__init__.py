"""kvgov: governance and audit layer for LLM KV cache.

Nothing happens at import: build what you need from :class:`kvgov.config.Settings`.
"""

__version__ = "0.1.0"
