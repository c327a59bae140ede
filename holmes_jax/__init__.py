"""holmes_jax: LLM training in pure JAX across GPU clusters whose NICs differ.

`holmes_jax.plan(topology, model, parallel)` plans a mesh; the submodule is imported on first use
so `python -m holmes_jax.plan` runs without a double import.
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "plan":
        import importlib

        return importlib.import_module("holmes_jax.plan")
    raise AttributeError(f"module 'holmes_jax' has no attribute {name!r}")
