"""holmes_jax's train step against a minimal hand-written jitted step of the same model.

Both run the same GPT, optimizer, batch size and data on the same 8 CPU devices (data parallel),
alternating in rounds so machine noise hits both alike; each round times `--steps` steps including
the host work of building each batch. Prints both throughputs and their ratio (target >= 0.95).
Gin bindings set the model, optimizer and data of both; ParallelConfig's pp, tp and microbatches
must stay 1 (the minimal step has no pipeline, tensor split or accumulation).

    python bench/overhead.py [--steps 20] [--rounds 5] [--gin.NAME=VALUE ...]

Last line: one JSON object: `minimal_tokens_per_s`, `holmes_tokens_per_s`, `ratio` (holmes /
minimal), `steps`, `rounds`.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax

jax.config.update("jax_platforms", "cpu")  # what it measures is the CPU devices', also on a GPU host
jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from holmes_jax import build, cli, configure, data, optimizer  # noqa: E402
from holmes_jax.config import ConfigError  # noqa: E402
from holmes_jax.mesh.devices import ordered_devices  # noqa: E402
from holmes_jax.models import gpt  # noqa: E402


def minimal_step(cfgs: configure.Configs, devices):
    """What a user writes by hand: replicated params, batch split over devices, one jit."""
    model = gpt.GPT(cfgs.model)
    tx, _ = optimizer.make_optimizer(cfgs.train)
    mesh = Mesh(np.asarray(devices), ("data",))
    replicated, batch_sharding = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # updates in place, as the holmes_jax step does
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(model.loss)(params, batch)
        params, opt_state, _ = optimizer.apply_gradients(tx, cfgs.train.grad_clip, params, opt_state, grads)
        return params, opt_state, loss

    params = jax.device_put(model.init(cfgs.train.seed), replicated)
    # all of the state replicated, as the step returns it: else its second call compiles again
    return step, params, jax.device_put(tx.init(params), replicated), batch_sharding


def main(argv):
    parser = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=cli.positive_int, default=20)
    parser.add_argument("--rounds", type=cli.positive_int, default=5)
    args, gin_args = parser.parse_known_args(argv)
    try:
        cfgs = configure.load_configs(["--gin.ParallelConfig.pp=1", "--gin.ParallelConfig.dp=8",
                                       "--gin.ParallelConfig.microbatches=1", *gin_args])
    except ConfigError as e:  # what is left over goes to gin, whose list of flags leaves out this bench's own
        if str(e).startswith("unknown argument"):
            raise ConfigError(f"{e}, --steps N, --rounds N") from None
        raise
    par = cfgs.parallel
    if (par.pp, par.tp, par.microbatches) != (1, 1, 1):  # else the ratio would price that layout, not the framework
        raise ConfigError(f"ParallelConfig pp = {par.pp}, tp = {par.tp}, microbatches = {par.microbatches} is not "
                          f"allowed here; allowed: 1 each, as the minimal step it is timed against is data parallel, "
                          f"one batch a step (bench/pipeline.py measures the pipeline)")
    tokens = data.load(cfgs.data)
    devices = ordered_devices()
    d, seed = cfgs.data, cfgs.train.seed

    setup = build.build(cfgs, devices)
    holmes = build.make_train_step(setup)
    state = setup.init_state()
    step, params, opt_state, batch_sharding = minimal_step(cfgs, devices)

    def run_holmes(first):
        nonlocal state
        for k in range(first, first + args.steps):
            state, out = holmes(state, setup.batch("train", k, tokens))
        jax.block_until_ready(out)

    def run_minimal(first):
        nonlocal params, opt_state
        for k in range(first, first + args.steps):
            batch = jax.device_put(tokens.batch("train", seed, k, d.global_batch, d.seq_len), batch_sharding)
            params, opt_state, loss = step(params, opt_state, batch)
        jax.block_until_ready(loss)

    run_holmes(0), run_minimal(0)  # compile and warm up both
    times = {"holmes": [], "minimal": []}
    for r in range(args.rounds):
        for name, fn in (("minimal", run_minimal), ("holmes", run_holmes)):
            t = time.perf_counter()
            fn((r + 1) * args.steps)
            times[name].append((time.perf_counter() - t) / args.steps)
    tokens_per_step = d.global_batch * d.seq_len
    result = {name: tokens_per_step / float(np.median(ts)) for name, ts in times.items()}
    ratio = result["holmes"] / result["minimal"]
    print(f"model {cfgs.model.preset}, batch {d.global_batch} x {d.seq_len}, {len(devices)} {devices[0].platform} devices, "
          f"{args.rounds} rounds of {args.steps} steps (median)")
    print(f"minimal jitted step : {result['minimal']:>10,.0f} tokens/s")
    print(f"holmes_jax step     : {result['holmes']:>10,.0f} tokens/s")
    print(f"ratio holmes/minimal: {ratio:.3f} (target >= 0.95)")
    print(json.dumps({"minimal_tokens_per_s": result["minimal"], "holmes_tokens_per_s": result["holmes"],
                      "ratio": ratio, "steps": args.steps, "rounds": args.rounds}))


if __name__ == "__main__":
    cli.run(main)
