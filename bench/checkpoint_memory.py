"""Device memory of a checkpoint's save and restore, and of a fresh state, per device, on 8 CPU devices,
beside the train step's own.

A save turns the train state (staged layout) into the canonical one a checkpoint stores; a resume
turns a restored canonical state back; a fresh run makes its state through the canonical layout
too. For each layout this prints, per device, from the compiled programs (`memory_analysis`, no
timing): the train state, the canonical state, the peak of each program (its input, output and
temporary memory together), the train step's peak the same way and the plan's predicted memory
(the largest stage's `Prediction.stage_memory_bytes`, what decides whether a layout fits). A GPT
of 8 layers, hidden 512, ffn 2048, float32, Adam, GPipe with as many microbatches as stages, seq
64; then layouts with more activations (seq 256, or 8 microbatches) and with fewer (seq 16).

    python bench/checkpoint_memory.py

Last line: one JSON object, `rows`, one per layout: `pp`, `dp`, `tp`, `stage_layers`,
`microbatches`, `seq_len`, and in bytes per device `state_bytes`, `canonical_bytes`,
`save_peak_bytes` (the state, what the save makes and its temporaries), `restore_peak_bytes` (the
restored canonical state, the train state made of it and the temporaries), `fresh_peak_bytes` (a
fresh state and its temporaries), `step_peak_bytes` (the train step's state and batch, its new
state and its temporaries), `step_aliased_bytes` (of its output, what reuses its donated input:
the step's peak less this is what it needs at once) and `predicted_bytes` (the plan's memory of
its largest stage).
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

from holmes_jax import build, cli, configure  # noqa: E402

MODEL = ["--gin.ModelConfig.num_layers=8", "--gin.ModelConfig.hidden=512", "--gin.ModelConfig.num_heads=8",
         "--gin.ModelConfig.ffn_hidden=2048", "--gin.DataConfig.seq_len=64", "--gin.DataConfig.global_batch=16",
         "--gin.ParallelConfig.schedule=gpipe", "--gin.CheckpointConfig.enabled=False"]
# (pp, dp, tp, stage_layers[, microbatches, seq_len]): microbatches default to pp, seq_len to 64
LAYOUTS = [(1, 8, 1, None), (2, 4, 1, None), (4, 2, 1, None), (2, 2, 2, None), (2, 4, 1, [6, 2]),
           (4, 2, 1, [5, 1, 1, 1]), (8, 1, 1, None), (4, 2, 1, None, 4, 256), (4, 2, 1, None, 8, 64),
           (2, 4, 1, None, 4, 256), (8, 1, 1, None, 8, 16), (4, 2, 1, [5, 1, 1, 1], 4, 16)]


def per_device(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def measure(pp: int, dp: int, tp: int, stage_layers, microbatches: int | None = None, seq_len: int = 64) -> dict:
    layers = [f"--gin.ParallelConfig.stage_layers={stage_layers}"] if stage_layers else []
    microbatches = microbatches or pp
    cfgs = configure.load_configs(MODEL + layers + [
        f"--gin.ParallelConfig.pp={pp}", f"--gin.ParallelConfig.dp={dp}", f"--gin.ParallelConfig.tp={tp}",
        f"--gin.ParallelConfig.microbatches={microbatches}", f"--gin.DataConfig.seq_len={seq_len}"])
    setup = build.build(cfgs)
    state, canonical = setup.abstract_state(), setup.abstract_canonical()
    d = cfgs.data
    batch = jax.ShapeDtypeStruct((microbatches, d.global_batch // microbatches, seq_len + 1), jnp.int32,
                                 sharding=setup.batch_sharding)

    def analysis(jitted, *args):
        return jitted.lower(*args).compile().memory_analysis()

    def peak(m) -> int:
        return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes

    step = analysis(build.make_train_step(setup), state, batch)
    return {"pp": pp, "dp": dp, "tp": tp, "stage_layers": stage_layers, "microbatches": microbatches,
            "seq_len": seq_len, "state_bytes": per_device(state), "canonical_bytes": per_device(canonical),
            "save_peak_bytes": peak(analysis(setup.canonical, state)),
            "restore_peak_bytes": peak(analysis(setup.staged, canonical)),
            "fresh_peak_bytes": peak(analysis(setup._jitted_fresh_state)),
            "step_peak_bytes": peak(step), "step_aliased_bytes": step.alias_size_in_bytes,
            "predicted_bytes": max(setup.plan.prediction.stage_memory_bytes)}


def main(argv: list[str]) -> None:
    # no flags: --help must not run it
    cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    print(f"{'pp':>3} {'dp':>3} {'tp':>3} {'stage layers':>12} {'m':>2} {'seq':>4}  MiB per device: {'state':>6} "
          f"{'canonical':>9} {'save':>6} {'restore':>7} {'fresh':>6} {'step':>6} {'aliased':>7} {'predicted':>9}")
    rows = []
    for layout in LAYOUTS:
        row = measure(*layout)
        rows.append(row)
        mib = [row[k] / 2**20 for k in ("state_bytes", "canonical_bytes", "save_peak_bytes", "restore_peak_bytes",
                                        "fresh_peak_bytes", "step_peak_bytes", "step_aliased_bytes", "predicted_bytes")]
        print(f"{row['pp']:>3} {row['dp']:>3} {row['tp']:>3} {str(row['stage_layers'] or 'even'):>12} "
              f"{row['microbatches']:>2} {row['seq_len']:>4}  {'':>15} {mib[0]:>6.1f} {mib[1]:>9.1f} {mib[2]:>6.1f} "
              f"{mib[3]:>7.1f} {mib[4]:>6.1f} {mib[5]:>6.1f} {mib[6]:>7.1f} {mib[7]:>9.1f}", flush=True)
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    cli.run(main)
