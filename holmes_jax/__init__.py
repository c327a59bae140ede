"""holmes_jax: LLM training in pure JAX across GPU clusters whose NICs differ.

`holmes_jax.plan(topology, model, parallel)` plans a mesh (holmes_jax.planning, no JAX needed).
"""

__version__ = "0.1.0"


def plan(topology, model, parallel=None, **options):
    """Plans `model` on `topology`: see holmes_jax.planning.search.plan."""
    from holmes_jax.planning.search import plan as plan_  # planning loads on first use

    return plan_(topology, model, parallel, **options)
