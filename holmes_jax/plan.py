"""`python -m holmes_jax.plan`: topology + model -> Plan, printed (see holmes_jax.planning.cli).

For the Python API call `holmes_jax.plan(...)` (`holmes_jax.planning.plan`); this module is only the
command's entry point.
"""

from holmes_jax import cli
from holmes_jax.planning.cli import main

if __name__ == "__main__":
    cli.run(main)
