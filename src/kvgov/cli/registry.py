"""Attaches each command group to the root app.

One line per group; each group module exposes ``register(app)`` and imports its heavy
dependencies inside its commands, so ``kvgov --help`` stays fast.
"""

from __future__ import annotations

import importlib

import typer

#: modules under ``kvgov.cli`` that expose ``register(app: typer.Typer) -> None``
GROUPS: tuple[str, ...] = (
    "keys",
    "init",
    "db",
    "audit",
    "token",
    "tenant",
    "policy",
    "serve",
    "purge",
    "provenance",
    "demo",
    "health",
)


def register(app: typer.Typer) -> None:
    for name in GROUPS:
        module = importlib.import_module(f"kvgov.cli.{name}")
        module.register(app)
