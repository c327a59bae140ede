"""holmes_jax: LLM training in pure JAX across GPU clusters whose NICs differ.

`holmes_jax.plan(topology, model, parallel)` plans a mesh; `holmes_jax.load(workdir)` loads a trained
run's model (holmes_jax.inference). Both are imported on first use: importing the package starts no
JAX, and `python -m holmes_jax.plan` runs without a double import.
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "plan":
        import importlib

        return importlib.import_module("holmes_jax.plan")
    if name == "load":
        from holmes_jax.inference import load

        return load
    raise AttributeError(f"module 'holmes_jax' has no attribute {name!r}")
