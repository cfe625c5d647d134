"""kvgov's engine-side LMCache plugin (the ``lmcache`` extra): ``KvgovConnector``.

Imports only lmcache, torch, the standard library and :mod:`kvgov.wire`; never the sidecar.
Register it in LMCache's config::

    remote_storage_plugins: ["kvgov"]
    extra_config:
      remote_storage_plugin.kvgov.module_path: kvgov.connectors.lmcache
      remote_storage_plugin.kvgov.class_name: KvgovConnector
      kvgov.endpoint: unix:///run/kvgov/data.sock
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvgovConnector"]


def __getattr__(name: str) -> Any:
    # lazy, so that ``kvgov.connectors.lmcache.identity`` is importable without torch
    if name == "KvgovConnector":
        from kvgov.connectors.lmcache.connector import KvgovConnector

        return KvgovConnector
    raise AttributeError(name)
