"""The console commands pyproject.toml installs (holmes-train, holmes-plan, ...): each is its
module's `python -m` entry, so both spellings behave alike (one `error:` line and exit 2 on bad
input). Modules load on call, so a command imports only what it needs (holmes-plan: no JAX)."""

from __future__ import annotations

import importlib

from holmes_jax import cli


def _command(module: str):
    def run() -> None:
        cli.run(importlib.import_module(f"holmes_jax.{module}").main)

    run.__name__ = module
    return run


train, launch, profile, report = (_command(m) for m in ("train", "launch", "profile", "report"))
data, export, generate, plan = (_command(m) for m in ("data", "export", "generate", "plan"))
