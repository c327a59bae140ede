"""`python -m holmes_jax.plan`: topology + model -> Plan, printed (see holmes_jax.planning.cli).

For the Python API call `holmes_jax.plan(...)` (`holmes_jax.planning.plan`); this module is only the
command's entry point.
"""

import functools

from holmes_jax import cli, pictures
from holmes_jax.planning import cli as planning_cli

main = functools.partial(planning_cli.main, draw=pictures.draw_plan)

if __name__ == "__main__":
    cli.run(main)
