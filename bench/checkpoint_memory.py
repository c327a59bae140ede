"""Device memory of a checkpoint's save and restore, and of a fresh state, per device, on 8 CPU devices.

A save turns the train state (staged layout) into the canonical one a checkpoint stores; a resume
turns a restored canonical state back; a fresh run makes its state through the canonical layout
too. For each layout this prints, per device, from the compiled programs (`memory_analysis`, no
timing): the train state, the canonical state, and the peak of each program (its input, output
and temporary memory together). A GPT of 8 layers, hidden 512, ffn 2048, float32, Adam.

    python bench/checkpoint_memory.py

Last line: one JSON object, `rows`, one per layout: `pp`, `dp`, `tp`, `stage_layers`, and in bytes
per device `state_bytes`, `canonical_bytes`, `save_peak_bytes` (the state, what the save makes and
its temporaries), `restore_peak_bytes` (the restored canonical state, the train state made of it
and the temporaries) and `fresh_peak_bytes` (a fresh state and its temporaries).
"""

from __future__ import annotations

import argparse
import json
import math

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

from holmes_jax import build, cli, configure  # noqa: E402

MODEL = ["--gin.ModelConfig.num_layers=8", "--gin.ModelConfig.hidden=512", "--gin.ModelConfig.num_heads=8",
         "--gin.ModelConfig.ffn_hidden=2048", "--gin.DataConfig.seq_len=64", "--gin.DataConfig.global_batch=16",
         "--gin.ParallelConfig.schedule=gpipe", "--gin.CheckpointConfig.enabled=False"]
LAYOUTS = [(1, 8, 1, None), (2, 4, 1, None), (4, 2, 1, None), (2, 2, 2, None), (2, 4, 1, [6, 2]),
           (4, 2, 1, [5, 1, 1, 1])]


def per_device(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def measure(pp: int, dp: int, tp: int, stage_layers) -> dict:
    layers = [f"--gin.ParallelConfig.stage_layers={stage_layers}"] if stage_layers else []
    cfgs = configure.load_configs(MODEL + layers + [
        f"--gin.ParallelConfig.pp={pp}", f"--gin.ParallelConfig.dp={dp}", f"--gin.ParallelConfig.tp={tp}",
        f"--gin.ParallelConfig.microbatches={pp}"])
    setup = build.build(cfgs)
    state, canonical = setup.abstract_state(), setup.abstract_canonical()

    def peak(jitted, *args) -> int:
        m = jitted.lower(*args).compile().memory_analysis()
        return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes

    return {"pp": pp, "dp": dp, "tp": tp, "stage_layers": stage_layers, "state_bytes": per_device(state),
            "canonical_bytes": per_device(canonical), "save_peak_bytes": peak(setup.canonical, state),
            "restore_peak_bytes": peak(setup.staged, canonical), "fresh_peak_bytes": peak(setup._jitted_fresh_state)}


def main(argv: list[str]) -> None:
    # no flags: --help must not run it
    cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    print(f"{'pp':>3} {'dp':>3} {'tp':>3} {'stage layers':>12}  MiB per device: {'state':>6} {'canonical':>9} "
          f"{'save':>6} {'restore':>7} {'fresh':>6}")
    rows = []
    for layout in LAYOUTS:
        row = measure(*layout)
        rows.append(row)
        mib = [row[k] / 2**20 for k in ("state_bytes", "canonical_bytes", "save_peak_bytes", "restore_peak_bytes",
                                        "fresh_peak_bytes")]
        print(f"{row['pp']:>3} {row['dp']:>3} {row['tp']:>3} {str(row['stage_layers'] or 'even'):>12}  "
              f"{'':>15} {mib[0]:>6.1f} {mib[1]:>9.1f} {mib[2]:>6.1f} {mib[3]:>7.1f} {mib[4]:>6.1f}", flush=True)
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    cli.run(main)
