"""The console commands pyproject.toml installs (holmes-train, holmes-plan, ...): each is its
module's `python -m` entry, so both spellings behave alike (one `error:` line and exit 2 on bad
input). Modules load on call, so a command imports only what it needs (holmes-plan: no JAX)."""

from __future__ import annotations

import functools

from holmes_jax import cli


def train() -> None:
    from holmes_jax import train as module

    cli.run(module.main)


def plan() -> None:
    # not through the holmes_jax.plan module: importing it would shadow the function holmes_jax.plan
    from holmes_jax import pictures
    from holmes_jax.planning import cli as planning_cli

    cli.run(functools.partial(planning_cli.main, draw=pictures.draw_plan))


def launch() -> None:
    from holmes_jax import launch as module

    cli.run(module.main)


def profile() -> None:
    from holmes_jax import profile as module

    cli.run(module.main)


def report() -> None:
    from holmes_jax import report as module

    cli.run(module.main)


def data() -> None:
    from holmes_jax import data as module

    cli.run(module.main)


def export() -> None:
    from holmes_jax import export as module

    cli.run(module.main)


def generate() -> None:
    from holmes_jax import generate as module

    cli.run(module.main)
