"""The holmes_jax train step on the local accelerator against a minimal hand-written step.

For each model (default: GPT-1.3B, then 125M) in bfloat16 at sequence 2048: the full step as
`python -m holmes_jax.train` builds it (`build.build`, pp = 1, data parallel over every local
device, ZeRO-1, clipping, the learning-rate schedule) beside a minimal jitted step of the same
model (replicated parameters, batch split over the devices, `jax.value_and_grad` + `optax.adamw`).
Both take the same random tokens; they alternate in rounds and the median step counts. Prints step
time, tokens/s, TFLOPS per device by Megatron's formula, MFU against the device's dense bf16 peak
(`metrics.device_peak_tflops`) and holmes/minimal throughput.

Without a GPU it measures a tiny model on the CPU devices instead (so CI runs this code) and says
plainly that no GPU was measured. The last line is one JSON object: `device_kind`, `model`, `mfu`,
`tflops_per_device`, `minimal_ratio`, `gpu_measured` of the first model, and `runs` with every
model's figures.

    python bench/gpu.py [--models 1.3b,125m] [--seq-len 2048] [--batch-per-device 1] [--dtype bfloat16]
                        [--remat none] [--steps 5] [--rounds 3] [--cpu-setting]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)  # only used without an accelerator

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from holmes_jax import build, cli, configure, metrics  # noqa: E402
from holmes_jax.mesh.devices import ordered_devices  # noqa: E402
from holmes_jax.planning import workload  # noqa: E402
from holmes_jax.models import gpt  # noqa: E402

CPU_SETTING = {"models": "tiny", "seq_len": 128, "batch_per_device": 1, "dtype": "float32"}


def configs(model: str, seq_len: int, global_batch: int, dtype: str, remat: str, devices: int) -> configure.Configs:
    return configure.load_configs([
        f"--gin.ModelConfig.preset='{model}'", f"--gin.ModelConfig.compute_dtype='{dtype}'",
        f"--gin.ModelConfig.remat='{remat}'", f"--gin.ModelConfig.max_seq_len={seq_len}",
        "--gin.ParallelConfig.pp=1", "--gin.ParallelConfig.tp=1", f"--gin.ParallelConfig.dp={devices}",
        "--gin.ParallelConfig.microbatches=1", f"--gin.ParallelConfig.cpu_devices={devices}",
        f"--gin.DataConfig.seq_len={seq_len}", f"--gin.DataConfig.global_batch={global_batch}",
        "--gin.CheckpointConfig.enabled=False",
    ])


def minimal_step(cfgs: configure.Configs, devices):
    """What a user writes by hand: replicated float32 parameters, the batch split over devices."""
    model, t = gpt.GPT(cfgs.model), cfgs.train
    tx = optax.adamw(t.learning_rate, t.beta1, t.beta2, weight_decay=t.weight_decay)
    mesh = Mesh(np.asarray(devices), ("data",))
    replicated = NamedSharding(mesh, P())

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # updates in place, as the holmes_jax step does
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(model.loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.device_put(model.init(t.seed), replicated)
    # all of the state replicated, as the step returns it: else its second call compiles again
    return step, params, jax.device_put(tx.init(params), replicated), NamedSharding(mesh, P("data"))


def measure(model: str, seq_len: int, batch_per_device: int, dtype: str, remat: str, steps: int, rounds: int) -> dict:
    devices = ordered_devices()
    cfgs = configs(model, seq_len, batch_per_device * len(devices), dtype, remat, len(devices))
    d, m = cfgs.data, cfgs.model
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, (d.global_batch, d.seq_len + 1), dtype=np.int32)

    setup = build.build(cfgs, devices)
    holmes = build.make_train_step(setup)
    state = setup.init_state()
    holmes_batch = jax.device_put(tokens[None], setup.batch_sharding)  # (microbatches = 1, batch, seq + 1)
    step, params, opt_state, batch_sharding = minimal_step(cfgs, devices)
    minimal_batch = jax.device_put(tokens, batch_sharding)

    def run_holmes():
        nonlocal state
        for _ in range(steps):
            state, out = holmes(state, holmes_batch)
        jax.block_until_ready(out)

    def run_minimal():
        nonlocal params, opt_state
        for _ in range(steps):
            params, opt_state, loss = step(params, opt_state, minimal_batch)
        jax.block_until_ready(loss)

    run_holmes(), run_minimal()  # compile and warm up
    times = {"holmes": [], "minimal": []}
    for _ in range(rounds):
        for name, fn in (("minimal", run_minimal), ("holmes", run_holmes)):
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) / steps)
    step_s = {name: float(np.median(ts)) for name, ts in times.items()}
    flops = workload.megatron_flops(d.global_batch, d.seq_len, m.num_layers, m.hidden, m.vocab_size, m.remat)
    tflops = {name: flops / s / len(devices) / 1e12 for name, s in step_s.items()}
    peak = metrics.device_peak_tflops(devices[0].device_kind)
    return {
        "model": model, "params": gpt.count_params(jax.eval_shape(lambda: setup.model.init(0))),
        "devices": len(devices), "device_kind": devices[0].device_kind, "dtype": dtype, "remat": m.remat,
        "seq_len": d.seq_len, "global_batch": d.global_batch, "step_s": step_s["holmes"],
        "minimal_step_s": step_s["minimal"], "tokens_per_s": d.global_batch * d.seq_len / step_s["holmes"],
        "tflops_per_device": tflops["holmes"], "minimal_tflops_per_device": tflops["minimal"],
        "mfu": None if peak is None else tflops["holmes"] / peak,
        "minimal_ratio": step_s["minimal"] / step_s["holmes"],  # holmes throughput / minimal throughput
    }


def main(argv):
    parser = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="1.3b,125m", help="presets, comma separated (first one headlines)")
    parser.add_argument("--seq-len", type=cli.positive_int, default=2048)
    parser.add_argument("--batch-per-device", type=cli.positive_int, default=1, help="sequences per device per step")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--remat", default="none", choices=("none", "full", "dots"))
    parser.add_argument("--steps", type=cli.positive_int, default=5, help="steps per round")
    parser.add_argument("--rounds", type=cli.positive_int, default=3)
    parser.add_argument("--cpu-setting", action="store_true",
                        help="the tiny CPU setting even on a GPU (what runs when there is none)")
    args = parser.parse_args(argv)
    gpu = jax.devices()[0].platform == "gpu"
    if not gpu or args.cpu_setting:
        why = "--cpu-setting" if gpu else f"{jax.devices()[0].platform} devices only"
        print(f"no GPU measured: {why}; running the {CPU_SETTING['models']} "
              f"model on them instead (checks this code, says nothing about GPU speed)")
        for name, value in CPU_SETTING.items():
            setattr(args, name, value)
    # each once: a repeated preset would be built and measured twice
    models, n = list(dict.fromkeys(args.models.split(","))), len(jax.devices())
    for model in models:  # a bad preset fails here, not after the models before it were measured
        configs(model, args.seq_len, args.batch_per_device * n, args.dtype, args.remat, n)
    runs = []
    for model in models:
        try:
            r = measure(model, args.seq_len, args.batch_per_device, args.dtype, args.remat, args.steps, args.rounds)
        except jax.errors.JaxRuntimeError as e:  # XLA's out-of-memory is a long traceback: say what to change
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise cli.RunError(f"{model} at batch {args.batch_per_device} x {args.seq_len} per device does not fit "
                               f"in the devices' memory (both steps' state is held at once): try --remat dots or "
                               f"full, or a smaller --batch-per-device or --seq-len ({str(e).splitlines()[0]})") from None
        runs.append(r)
        mfu = "n/a (no known peak)" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        print(f"{r['model']} ({r['params'] / 1e6:,.0f} M params), {r['dtype']}, remat {r['remat']}, "
              f"{r['devices']} x {r['device_kind']}, batch {r['global_batch']} x {r['seq_len']}: "
              f"holmes {r['step_s'] * 1e3:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, "
              f"{r['tflops_per_device']:.4g} TFLOPS/device, MFU {mfu} | minimal {r['minimal_step_s'] * 1e3:.1f} ms/step "
              f"| holmes/minimal throughput {r['minimal_ratio']:.3f}")
    head = runs[0]
    print(json.dumps({"device_kind": head["device_kind"], "model": head["model"], "mfu": head["mfu"],
                      "tflops_per_device": head["tflops_per_device"], "minimal_ratio": head["minimal_ratio"],
                      "gpu_measured": gpu and not args.cpu_setting, "runs": runs}))


if __name__ == "__main__":
    cli.run(main)
