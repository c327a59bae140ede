"""The console commands pyproject.toml installs (holmes-train, holmes-plan, ...): each is its
module's `python -m` entry, so both spellings behave alike (one `error:` line and exit 2 on bad
input). Modules load on call, so a command imports only what it needs (holmes-plan: no JAX)."""

from __future__ import annotations

import functools
import importlib

from holmes_jax import cli


def _command(module: str):
    def run() -> None:
        cli.run(importlib.import_module(f"holmes_jax.{module}").main)

    run.__name__ = module
    return run


train, launch, profile, report = (_command(m) for m in ("train", "launch", "profile", "report"))
data, export, generate = (_command(m) for m in ("data", "export", "generate"))


def plan() -> None:
    # not through the holmes_jax.plan module: importing it would shadow the function holmes_jax.plan
    from holmes_jax import pictures
    from holmes_jax.planning import cli as planning_cli

    cli.run(functools.partial(planning_cli.main, draw=pictures.draw_plan))
