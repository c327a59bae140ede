"""holmes_jax: LLM training in pure JAX across GPU clusters whose NICs differ.

`holmes_jax.plan(topology, model, parallel)` plans a mesh (holmes_jax.planning, no JAX needed);
`holmes_jax.load(workdir)` loads a trained run's model (holmes_jax.inference). Both import their
module on first use, so importing the package starts no JAX. Text from a loaded model `m`:

    from holmes_jax.generate import decode, encode, generate
    prompt = encode(m, "def main(")                       # token ids, as the run's data was tokenized
    print(decode(m, prompt + generate(m, prompt, 32, top_k=20)))
"""

__version__ = "0.1.0"


def plan(topology, model, parallel=None, **options):
    """Plans `model` on `topology`: see holmes_jax.planning.search.plan."""
    from holmes_jax.planning.search import plan as plan_

    return plan_(topology, model, parallel, **options)


def load(workdir, step=None):
    """The newest (or `step`'s) checkpoint of a run: see holmes_jax.inference.load."""
    from holmes_jax.inference import load as load_

    return load_(workdir, step)
