"""`python -m holmes_jax.plan`: topology + model -> Plan, printed (see holmes_jax.planning.cli).

For the Python API call `holmes_jax.plan(...)` (`holmes_jax.planning.plan`); this module is only the
command's entry point.
"""

import functools
import sys
import types

from holmes_jax import cli
from holmes_jax.planning import cli as planning_cli


def _draw_plan(plan, path) -> None:
    from holmes_jax import pictures  # matplotlib takes most of a second to import: only for --draw

    pictures.draw_plan(plan, path)


main = functools.partial(planning_cli.main, draw=_draw_plan)


class _CallableModule(types.ModuleType):
    """Importing this module binds it to the name `holmes_jax.plan`, where the package's function
    was (Python sets a package's submodules as its attributes): calling it still plans."""

    def __call__(self, topology, model, parallel=None, **options):
        from holmes_jax.planning.search import plan

        return plan(topology, model, parallel, **options)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    cli.run(main)
