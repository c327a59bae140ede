"""Pipeline cost on one process with 8 CPU devices: pp = 2 and 4 against pp = 1.

Every configuration trains the same model on the same global batch (data parallel over the
devices left after pp), and their steps are timed in alternating rounds. The pp = 1 baseline of a
(pp, m) row runs m / pp microbatches, so each device multiplies matrices of the same shape in both
(the same per-device microbatch): XLA's CPU speed depends strongly on those shapes, and the ratio
should show the pipeline's cost, not a change of matmul size. CPU devices share the
host's cores, so an idle stage frees its core for the others: the measured ratio shows the work a
pipeline adds (bubble work it fails to skip, p2p, bookkeeping), while the theoretical
(m + p - 1) / m is what the bubble costs on devices that cannot lend each other their time.
Then the compiled step's temporary memory per device (`memory_analysis`) as m grows with the
microbatch size held fixed: GPipe keeps what every microbatch's backward needs alive, 1F1B at most
2p - 1 microbatches' worth.

stage_work_ratio: the compute of a stage other than the last, per microbatch, as the runtime runs
it (its forward tick, which keeps the layers' residuals, plus its backward tick, which uses them;
two separate jitted calls, so the residuals are materialised as in the stash) over a plain
`jax.value_and_grad` forward + backward of the same layers (no remat) on the same microbatch and
device. About 1 with remat 'none' (each layer's forward runs once), about 4/3 with 'full'.
stage_flops_ratio: the same quotient in FLOPs as XLA counts them in the compiled programs; on CPU
the timed ratio also carries memory traffic (the stash), this one only the work.

    python bench/pipeline.py [--rounds 3] [--steps 2] [--microbatches 4,8,16] [--remat none|full|dots]

Last line: one JSON object: `rows`, one a (pp, m, schedule) with `pp`, `m`, `schedule`, `remat`,
`step_s` and `baseline_s` (the pp = 1 step, s), `measured_ratio`, `theory_ratio`, `temp_bytes`,
`stage_work_ratio`, `stage_flops_ratio`; `worst_measured_over_theory` (target <= 1.15); `remat`;
`stage_work_ratio` and `stage_flops_ratio` by 'pp=P,m=M'.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax

jax.config.update("jax_platforms", "cpu")  # what it measures is the CPU devices', also on a GPU host
jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import jax.numpy as jnp  # noqa: E402

from holmes_jax import build, cli, configure, data  # noqa: E402
from holmes_jax.models import gpt  # noqa: E402
from holmes_jax.pipeline.runtime import _Layers  # noqa: E402

MODEL = ["--gin.ModelConfig.num_layers=4", "--gin.ModelConfig.hidden=128", "--gin.ModelConfig.num_heads=4",
         "--gin.DataConfig.seq_len=64", "--gin.DataConfig.global_batch=128", "--gin.CheckpointConfig.enabled=False"]


def microbatch_counts(text: str) -> list[int]:
    """An argparse `type` for --microbatches: a multiple of 4, as the baseline of pp = 4 runs m / 4
    microbatches, that divides 32, as at pp = 2 each of the 4 data replicas holds 32 sequences."""
    allowed = (4, 8, 16, 32)
    if not all(m.isdecimal() and int(m) in allowed for m in text.split(",")):  # isdigit took "²"
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a comma-separated list of "
                                         + ", ".join(map(str, allowed)))
    # each once: a repeated count would be built, timed and printed twice
    return list(dict.fromkeys(int(m) for m in text.split(",")))


def _setup(pp: int, m: int, schedule: str, remat: str, *extra: str) -> build.Setup:
    return build.build(configure.load_configs(MODEL + [f"--gin.ParallelConfig.pp={pp}", f"--gin.ParallelConfig.microbatches={m}",
                                                   f"--gin.ParallelConfig.schedule={schedule}",
                                                   f"--gin.ModelConfig.remat='{remat}'", *extra]))


def temp_bytes_fixed_microbatch(pp: int, m: int, schedule: str, remat: str) -> int:
    """Compiled temporary memory with 8 sequences of 256 tokens per microbatch per data shard."""
    dp = 8 // pp
    setup = _setup(pp, m, schedule, remat, "--gin.DataConfig.seq_len=256", f"--gin.DataConfig.global_batch={8 * dp * m}")
    state = jax.eval_shape(setup.init_state)
    batch = jax.ShapeDtypeStruct((m, 8 * dp, 257), np.int32, sharding=setup.batch_sharding)
    return int(build.make_train_step(setup).lower(state, batch).compile().memory_analysis().temp_size_in_bytes)


def _stage_and_plain(pp: int, m: int, remat: str):
    """A non-last stage's forward tick and backward tick (as the runtime runs them, two jitted
    calls so the residuals are materialised as in the stash) and a plain value_and_grad of the
    same layers, each with its arguments, on the first device with the step's per-device microbatch."""
    cfgs = configure.load_configs(MODEL + [f"--gin.ModelConfig.remat='{remat}'"])
    micro_batch = cfgs.data.global_batch // ((8 // pp) * m)
    layers = cfgs.model.num_layers // pp
    model, plain_model = gpt.GPT(cfgs.model), gpt.GPT(dataclasses.replace(cfgs.model, remat="none"))
    device = jax.devices()[0]
    blocks = jax.device_put(jax.tree.map(lambda x: x[:layers], model.init(0)["blocks"]), device)
    rng = np.random.default_rng(0)
    shape = (micro_batch, cfgs.data.seq_len, cfgs.model.hidden)
    x, g = (jax.device_put(jnp.asarray(rng.standard_normal(shape), jnp.float32), device) for _ in range(2))
    stage = _Layers(model, blocks, x, None)
    ring = jax.device_put(stage.ring(1), device)  # one microbatch's room, written in place as in the step
    forward = jax.jit(lambda b, x, ring: _Layers(model, b, x, None).forward(x, ring, 0), donate_argnums=2)
    backward = jax.jit(lambda b, ring, g: _Layers(model, b, g, None).backward(ring, 0, g, jax.tree.map(jnp.zeros_like, b)))
    plain = jax.jit(jax.value_and_grad(lambda b, x, g: jnp.vdot(plain_model.blocks(b, x), g), argnums=(0, 1)))
    return (forward, (blocks, x, ring)), (backward, (blocks, ring, g)), (plain, (blocks, x, g))


def stage_flops_ratio(pp: int, m: int, remat: str) -> float:
    """The same ratio as `stage_work_ratio`, in FLOPs as XLA counts them in the compiled
    programs (`cost_analysis`): the work itself, free of the host's memory traffic and noise."""
    def flops(fn, args):
        return fn.lower(*args).compile().cost_analysis()["flops"]

    forward, backward, plain = _stage_and_plain(pp, m, remat)
    return float((flops(*forward) + flops(*backward)) / flops(*plain))


def stage_work_ratio(pp: int, m: int, remat: str, rounds: int, repeats: int = 5) -> float:
    """One stage's forward tick + backward tick over a plain value_and_grad of its layers (see the
    module doc), timed; the best of the rounds (the host is shared: the fastest round is the one
    least disturbed)."""
    (forward, (blocks, x, ring)), (backward, (_, _, g)), (plain, _) = _stage_and_plain(pp, m, remat)

    def stage():
        nonlocal ring
        _, ring = forward(blocks, x, ring)
        return backward(blocks, ring, g)

    def baseline():
        return plain(blocks, x, g)

    times = {stage: [], baseline: []}
    for fn in times:
        jax.block_until_ready(fn())  # compile and warm up
    for _ in range(rounds):
        for fn, ts in times.items():
            t = time.perf_counter()
            for _ in range(repeats):
                out = fn()
            jax.block_until_ready(out)
            ts.append((time.perf_counter() - t) / repeats)
    return float(min(times[stage]) / min(times[baseline]))


def prepare(pp: int, m: int, schedule: str, remat: str, tokens):
    setup = _setup(pp, m, schedule, remat)
    state = setup.init_state()
    batches = [setup.batch("train", k, tokens) for k in range(2)]
    compiled = build.make_train_step(setup).lower(state, batches[0]).compile()
    state, out = compiled(state, batches[0])  # warm up
    jax.block_until_ready(out)
    return {"compiled": compiled, "state": state, "batches": batches}


def time_steps(run: dict, steps: int) -> float:
    t = time.perf_counter()
    for k in range(steps):
        run["state"], out = run["compiled"](run["state"], run["batches"][k % 2])
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / steps


def main(argv):
    parser = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=cli.positive_int, default=3)
    parser.add_argument("--steps", type=cli.positive_int, default=2)
    parser.add_argument("--microbatches", type=microbatch_counts, default="4,8,16")
    parser.add_argument("--remat", default="none", choices=("none", "full", "dots"))
    args = parser.parse_args(argv)
    tokens = data.load(configure.load_configs(MODEL).data)
    ms = args.microbatches
    piped = [(pp, m, sched) for m in ms for pp in (2, 4) for sched in ("gpipe", "1f1b")]
    baselines = sorted({(1, m // pp, "gpipe") for pp, m, _ in piped})
    runs = {c: prepare(*c, args.remat, tokens) for c in baselines + piped}
    times = {c: [] for c in runs}
    for _ in range(args.rounds):
        for c in runs:
            times[c].append(time_steps(runs[c], args.steps))
    median = {c: float(np.median(ts)) for c, ts in times.items()}
    rows = []
    for pp, m, sched in piped:
        base = median[(1, m // pp, "gpipe")]
        rows.append({"pp": pp, "m": m, "schedule": sched, "step_s": median[(pp, m, sched)], "baseline_s": base,
                     "measured_ratio": median[(pp, m, sched)] / base, "theory_ratio": (m + pp - 1) / m,
                     "remat": args.remat})
    del runs
    shapes = dict.fromkeys((pp, m) for pp, m, _ in piped)  # the stage work does not depend on the schedule: timed once
    work = {(pp, m): stage_work_ratio(pp, m, args.remat, args.rounds) for pp, m in shapes}
    work_flops = {(pp, m): stage_flops_ratio(pp, m, args.remat) for pp, m in work}
    for row in rows:
        row["stage_work_ratio"] = work[(row["pp"], row["m"])]
        row["stage_flops_ratio"] = work_flops[(row["pp"], row["m"])]
    print(f"remat {args.remat}; temp MiB: compiled temporary memory per device with 8 x 256 tokens per microbatch "
          f"and data shard; stage work: a non-last stage's forward + backward tick over plain value_and_grad")
    print(f"{'pp':>3} {'m':>3} {'schedule':>8} {'step ms':>9} {'pp=1 ms':>9} {'measured':>9} {'theory':>7} {'temp MiB':>9} "
          f"{'stage work':>10} {'flops':>6}")
    for row in rows:
        row["temp_bytes"] = temp_bytes_fixed_microbatch(row["pp"], row["m"], row["schedule"], args.remat)
        print(f"{row['pp']:>3} {row['m']:>3} {row['schedule']:>8} {row['step_s'] * 1e3:>9.1f} {row['baseline_s'] * 1e3:>9.1f} "
              f"{row['measured_ratio']:>9.3f} {row['theory_ratio']:>7.3f} {row['temp_bytes'] / 2**20:>9.2f} "
              f"{row['stage_work_ratio']:>10.3f} {row['stage_flops_ratio']:>6.3f}")
    worst = max(r["measured_ratio"] / r["theory_ratio"] for r in rows)
    print(f"worst measured / theory: {worst:.3f} (target <= 1.15)")
    for pp in (2, 4):
        for sched in ("gpipe", "1f1b"):
            mem = [r["temp_bytes"] for r in rows if r["pp"] == pp and r["schedule"] == sched]
            print(f"pp={pp} {sched:>5} temp MiB over m: " + ", ".join(f"{b / 2**20:.2f}" for b in mem))
    print(f"stage work ratio (non-last stage tick work / plain value_and_grad), remat {args.remat}: "
          + ", ".join(f"pp={pp} m={m}: {r:.3f}" for (pp, m), r in work.items()))
    print("the same in XLA's FLOP count: " + ", ".join(f"pp={pp} m={m}: {r:.3f}" for (pp, m), r in work_flops.items()))
    print(json.dumps({"rows": rows, "worst_measured_over_theory": worst, "remat": args.remat,
                      "stage_work_ratio": {f"pp={pp},m={m}": r for (pp, m), r in work.items()},
                      "stage_flops_ratio": {f"pp={pp},m={m}": r for (pp, m), r in work_flops.items()}}))


if __name__ == "__main__":
    cli.run(main)
