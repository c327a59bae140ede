"""`python -m holmes_jax.train [--gin_file F ...] [--gin.NAME=VALUE ...]`: the one path a run takes.

configs -> devices and mesh -> model and optimizer state (restored when the workdir holds a
checkpoint) -> jitted train step, compiled ahead of time -> loop: batch, step, metrics, periodic
validation and checkpoints -> summary. See DESIGN.md section 3.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import time
from pathlib import Path

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from holmes_jax import cli, data, distributed, export, metrics
from holmes_jax import plan as plan_api
from holmes_jax.checkpoint import Checkpointer
from holmes_jax.config import CheckpointConfig, ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from holmes_jax.mesh import planner, topology
from holmes_jax.models import gpt, presets
from holmes_jax.pipeline.runtime import Pipeline
from holmes_jax.plan import Plan

DEFAULT_GIN = Path(__file__).resolve().parent.parent / "configs" / "default.gin"
MESH_AXES = ("stage", "data", "tensor")
USAGE = """usage: python -m holmes_jax.train [--gin_file FILE ...] [--gin.NAME=VALUE ...]

Trains a GPT. Without --gin_file, configs/default.gin is used. NAME is a config field such as
TrainConfig.steps, TrainConfig.workdir, ParallelConfig.dp, ParallelConfig.tp, ModelConfig.preset."""


@dataclasses.dataclass(frozen=True)
class Configs:
    model: ModelConfig
    parallel: ParallelConfig
    data: DataConfig
    train: TrainConfig
    checkpoint: CheckpointConfig


# ----------------------------------------------------------------------------- configuration


def _gin_value(text: str) -> str:
    """A gin literal for `text`; bare words (paths, 'gpipe') become strings so users need no quotes."""
    if text.startswith(("@", "%")):
        return text
    try:
        return repr(ast.literal_eval(text))
    except (ValueError, SyntaxError):
        return repr(text)


def parse_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Splits argv into gin files and gin bindings ('Class.field = value')."""
    files, bindings = [], []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            print(USAGE)
            raise SystemExit(0)
        if arg == "--gin_file" or arg.startswith("--gin_file="):
            value = arg.partition("=")[2] if "=" in arg else (args.pop(0) if args else None)
            if not value:
                raise ConfigError("--gin_file needs a file name")
            files.append(value)
        elif arg.startswith("--gin."):
            name, eq, value = arg[len("--gin."):].partition("=")
            if not eq:
                if not args:
                    raise ConfigError(f"--gin.{name} needs a value: --gin.{name}=VALUE")
                value = args.pop(0)
            bindings.append(f"{name} = {_gin_value(value)}")
        else:
            raise ConfigError(f"unknown argument {arg!r}; allowed: --gin_file FILE, --gin.NAME=VALUE, --help")
    return files, bindings


def load_configs(argv: list[str]) -> Configs:
    """Parses gin files and bindings into validated configs (the model resolved from its preset)."""
    files, bindings = parse_args(argv)
    for f in files:
        if not Path(f).is_file():
            raise ConfigError(f"--gin_file {f!r}: no such file")
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(files or [str(DEFAULT_GIN)], bindings)
        cfgs = Configs(ModelConfig(), ParallelConfig(), DataConfig(), TrainConfig(), CheckpointConfig())
    except ConfigError:
        raise
    except Exception as e:  # gin reports unknown names and unparsable values with assorted types
        raise ConfigError("gin: " + " ".join(str(e).split())) from None
    for c in (cfgs.parallel, cfgs.data, cfgs.train, cfgs.checkpoint):
        c.validate()
    return dataclasses.replace(cfgs, model=presets.resolve(cfgs.model))


# ----------------------------------------------------------------------------- mesh and state


def ordered_devices(devices=None) -> list:
    """Devices in (process_index, id) order: ids are not positions across processes."""
    return sorted(devices or jax.devices(), key=lambda d: (d.process_index, d.id))


def peak_tflops(devices) -> tuple[float, str]:
    """Dense peak TFLOP/s of one device and where the figure comes from (measured once on CPU)."""
    kind = devices[0].device_kind
    peak = metrics.device_peak_tflops(kind)
    if peak is not None:
        return peak, f"{kind} dense bf16 peak"
    peak = _measured_peak(tuple(devices))
    return peak, f"measured float32 matmul peak of {kind} ({peak:.3g} TFLOPS/device)"


@functools.lru_cache(maxsize=None)
def _measured_peak(devices: tuple) -> float:
    return metrics.measure_matmul_peak_tflops(list(devices))


def make_plan(cfgs: Configs, devices) -> Plan:
    """The Plan for this run: the topology file's, or one emulated from the devices present."""
    par = cfgs.parallel
    if par.topology:
        topo = topology.load(par.topology)
    else:
        topo = planner.local_topology(devices, device_tflops=peak_tflops(devices)[0])
    return plan_api.plan(topo, cfgs.model, par, global_batch=cfgs.data.global_batch, seq_len=cfgs.data.seq_len)


def _zero1_spec(spec: P, shape: tuple, dp: int) -> P:
    """Adds `data` to the first unsplit axis of a leaf that `dp` divides (ZeRO stage 1)."""
    dims = list(spec) + [None] * (len(shape) - len(spec))
    for i, (name, size) in enumerate(zip(dims, shape)):
        if name is None and size % dp == 0:
            dims[i] = "data"
            return P(*dims)
    return spec


def gradient_specs(params_shapes: dict, stage_axis: str | None, dp: int, zero1: bool) -> dict:
    """Where gradients and optimizer moments live: the parameter's spec, split over `data` too
    with ZeRO-1 (so the gradient is reduce-scattered and each replica updates its shard)."""
    pspecs = gpt.param_specs(params_shapes, stage_axis)
    if not zero1:
        return pspecs
    return jax.tree.map(lambda spec, leaf: _zero1_spec(spec, leaf.shape, dp), pspecs, params_shapes,
                        is_leaf=lambda x: isinstance(x, P))


def optimizer_specs(opt_shapes, moment_specs: dict):
    """PartitionSpecs for optimizer state: a leaf under a parameter's path takes that parameter's
    moment spec; counters and scalars are replicated."""
    by_path = {tuple(path): spec for path, spec in
               jax.tree_util.tree_leaves_with_path(moment_specs, is_leaf=lambda x: isinstance(x, P))}

    def spec(path, leaf):
        for start in range(len(path)):
            match = by_path.get(tuple(path[start:]))
            if match is not None and len(leaf.shape) > 0:
                return match
        return P()

    return jax.tree_util.tree_map_with_path(spec, opt_shapes)


def make_optimizer(tcfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW on a warm-up cosine schedule. Gradient clipping is not chained in: `apply_gradients`
    clips by the one global norm it also reports (a chained clip beside a separately computed
    norm for the metrics made the step about 30 ms slower on the 4-process emulated testbed)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tcfg.learning_rate, warmup_steps=tcfg.warmup_steps,
        decay_steps=max(tcfg.steps, tcfg.warmup_steps + 1), end_value=tcfg.learning_rate * tcfg.min_lr_ratio,
    )

    def decay_mask(params):  # weight decay on matmul kernels and embeddings only, not norms
        return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", "") in ("kernel", "embedding"), params)

    tx = optax.adamw(schedule, b1=tcfg.beta1, b2=tcfg.beta2, weight_decay=tcfg.weight_decay, mask=decay_mask)
    return tx, schedule


def clip_gradients(grads, max_norm: float):
    """(grads scaled down to global norm `max_norm` where it is above, their global norm)."""
    norm = optax.global_norm(grads)
    scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-12))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads), norm


def apply_gradients(tx, max_norm: float, params, opt_state, grads, mask=lambda updates: updates):
    """One optimizer step: clip, update, apply (`mask` filters the updates first). Returns
    (params, opt_state, the gradients' global norm before clipping)."""
    grads, norm = clip_gradients(grads, max_norm)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, mask(updates)), opt_state, norm


@dataclasses.dataclass
class Setup:
    """Everything a run builds before its first step. The train state holds block parameters (and
    their optimizer moments) in the pipeline's staged layout; checkpoints hold the canonical one."""

    cfgs: Configs
    plan: Plan
    mesh: Mesh
    model: gpt.GPT
    pipeline: Pipeline
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    state_shardings: dict
    canonical_shardings: dict
    grad_specs: dict  # staged layout
    batch_sharding: NamedSharding  # (microbatches, micro_batch, seq + 1), split over `data`

    def _canonical_state(self, params: dict | None = None) -> dict:
        params = self.model.init(self.cfgs.train.seed) if params is None else params
        return {"params": params, "opt_state": self.tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def init_state(self) -> dict:
        params, folder = None, self.cfgs.model.init_from
        if folder:  # a Hugging Face model's weights, as global arrays (every process reads the files)
            params = jax.tree.map(lambda x, sh: jax.make_array_from_callback(x.shape, sh, lambda i: x[i]),
                                  export.import_hf(folder, self.cfgs.model), self.canonical_shardings["params"])
        return jax.jit(lambda p: self.pipeline.to_staged(self._canonical_state(p)), out_shardings=self.state_shardings)(params)

    def canonical(self, state: dict) -> dict:
        """What a checkpoint stores: real layers only, in model order."""
        return jax.jit(self.pipeline.to_canonical, out_shardings=self.canonical_shardings)(state)

    def staged(self, canonical: dict) -> dict:
        return jax.jit(self.pipeline.to_staged, out_shardings=self.state_shardings)(canonical)

    def abstract_canonical(self) -> dict:
        shapes = jax.eval_shape(self._canonical_state)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                            self.canonical_shardings)

    def batch(self, split: str, step: int, token_data: data.TokenData) -> jax.Array:
        """The global batch of `step`; on several processes each builds only its own shards."""
        d = self.cfgs.data
        tokens = token_data.batch(split, self.cfgs.train.seed, step, d.global_batch, d.seq_len)
        m = self.plan.microbatches
        tokens = tokens.reshape(m, d.global_batch // m, d.seq_len + 1)
        return jax.make_array_from_callback(tokens.shape, self.batch_sharding, lambda index: tokens[index])


def _state_shardings(mesh: Mesh, tx, params_shapes: dict, stage_axis: str | None, zero1: bool) -> dict:
    pspecs = gpt.param_specs(params_shapes, stage_axis)
    moments = gradient_specs(params_shapes, stage_axis, mesh.shape["data"], zero1)
    ospecs = optimizer_specs(jax.eval_shape(tx.init, params_shapes), moments)
    specs = {"params": pspecs, "opt_state": ospecs, "step": P()}
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def build(cfgs: Configs, devices=None) -> Setup:
    devices = ordered_devices(devices)
    the_plan = make_plan(cfgs, devices)
    mesh = the_plan.build_mesh(devices)
    par = cfgs.parallel
    model = gpt.GPT(cfgs.model)
    pipeline = Pipeline(model, mesh, the_plan.stage_layers, the_plan.microbatches, the_plan.schedule)
    tx, schedule = make_optimizer(cfgs.train)
    canonical = jax.eval_shape(lambda: model.init(0))
    staged = jax.eval_shape(pipeline.to_staged, canonical)
    return Setup(cfgs, the_plan, mesh, model, pipeline, tx, schedule,
                 _state_shardings(mesh, tx, staged, "stage", par.zero1),
                 _state_shardings(mesh, tx, canonical, None, par.zero1),
                 gradient_specs(staged, "stage", mesh.shape["data"], par.zero1),
                 NamedSharding(mesh, P(None, "data", None)))


# ----------------------------------------------------------------------------- the step


def make_train_step(setup: Setup):
    """The jitted step: the pipeline's loss and gradients over all microbatches, one AdamW update."""
    tx, pipeline = setup.tx, setup.pipeline

    def step(state, batch):
        loss, grads = pipeline.loss_and_grads(state["params"], batch, setup.grad_specs)
        params, opt_state, norm = apply_gradients(tx, setup.cfgs.train.grad_clip, state["params"], state["opt_state"],
                                                  grads, pipeline.mask_updates)
        new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
        return new_state, {"loss": loss, "grad_norm": norm}

    return jax.jit(step, in_shardings=(setup.state_shardings, setup.batch_sharding),
                   out_shardings=(setup.state_shardings, None), donate_argnums=0)


def make_eval_step(setup: Setup):
    """Validation loss of a batch through the same pipeline program. It also runs the backward
    (its gradients are dropped): simpler than a second forward-only schedule, and evaluation is rare."""
    return jax.jit(lambda params, batch: setup.pipeline.loss_and_grads(params, batch, setup.grad_specs)[0],
                   in_shardings=(setup.state_shardings["params"], setup.batch_sharding))


# ----------------------------------------------------------------------------- the run


def run(cfgs: Configs, devices=None, quiet: bool = False) -> dict:
    """Trains per `cfgs`; returns the summary. Everything is validated before the workdir is touched.
    With several processes, all of them step and checkpoint; process 0 alone prints and writes."""
    quiet = quiet or jax.process_index() != 0
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    token_data = data.load(cfgs.data)
    setup = build(cfgs, devices)
    devices = list(setup.mesh.devices.flat)
    tcfg, dcfg, mcfg = cfgs.train, cfgs.data, cfgs.model
    say(f"holmes_jax: {mcfg.preset} model, {gpt.count_params(jax.eval_shape(lambda: setup.model.init(0))):,} parameters; "
        f"mesh {dict(setup.mesh.shape)}, stage layers {list(setup.pipeline.stage_layers)}, "
        f"{setup.plan.schedule} over {setup.plan.microbatches} microbatches on {len(devices)} {devices[0].platform} devices")
    say(f"data: {token_data.description}")
    say(setup.plan.explain())

    workdir = Path(tcfg.workdir)
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.gin").write_text(gin.operative_config_str())
    ckpt = Checkpointer(workdir / "checkpoints", cfgs.checkpoint) if cfgs.checkpoint.enabled else None
    start = ckpt.latest_step() if ckpt else None
    if start is not None:
        state = setup.staged(ckpt.restore(start, setup.abstract_canonical()))
        say(f"resumed from checkpoint at step {start}")
    else:
        state, start = setup.init_state(), 0
    last_step = min(tcfg.steps, tcfg.stop_after or tcfg.steps)
    if start >= last_step:
        say(f"nothing to do: the checkpoint is at step {start}, the run ends at step {last_step}")
        ckpt and ckpt.close()
        return {"steps": start}

    train_step, eval_step = make_train_step(setup), make_eval_step(setup)
    t0 = time.perf_counter()
    compiled = train_step.lower(state, setup.batch("train", start, token_data)).compile()
    mem = compiled.memory_analysis()
    say(f"compiled the train step in {time.perf_counter() - t0:.1f} s"
        + (f"; temporary memory {mem.temp_size_in_bytes / 2**20:.1f} MiB per device" if mem else ""))
    peak, peak_what = peak_tflops(devices)
    say(f"MFU is against the {peak_what}")

    flops = metrics.megatron_flops(dcfg.global_batch, dcfg.seq_len, mcfg.num_layers, mcfg.hidden,
                                   mcfg.vocab_size, recompute=mcfg.remat)
    tokens_per_step = dcfg.global_batch * dcfg.seq_len
    log = metrics.MetricsLog(workdir / "metrics.jsonl", tcfg.steps, quiet) if jax.process_index() == 0 else None
    pending, t_last, step, rows = [], time.perf_counter(), start, []
    try:
        for step in range(start + 1, last_step + 1):
            state, out = compiled(state, setup.batch("train", step - 1, token_data))
            pending.append(out)
            if step % tcfg.log_every == 0 or step == last_step or step == start + 1:
                losses = jax.device_get(pending)
                elapsed = (time.perf_counter() - t_last) / len(pending)
                row = {"step": step, "loss": float(losses[-1]["loss"]), "grad_norm": float(losses[-1]["grad_norm"]),
                       "lr": float(setup.schedule(step - 1)), "step_time_s": elapsed,
                       "tokens_per_s": tokens_per_step / elapsed,
                       "tflops_per_device": flops / elapsed / len(devices) / 1e12}
                row["mfu"] = row["tflops_per_device"] / peak
                if step % tcfg.eval_every == 0 or step == last_step:
                    row["val_loss"] = evaluate(setup, eval_step, state["params"], token_data)
                log and log.write(row)
                rows.append(row)
                pending, t_last = [], time.perf_counter()
            if ckpt:
                ckpt.save(step, lambda: setup.canonical(state), force=step == last_step)
    except KeyboardInterrupt:
        if ckpt and step > start:
            say(f"interrupted: saving a checkpoint at step {step}")
            ckpt.save(step, lambda: setup.canonical(state), force=True)
        ckpt and ckpt.close()
        raise
    ckpt and ckpt.close()
    return summarize(rows, start, setup.plan.prediction.step_time_s, say)


def evaluate(setup: Setup, eval_step, params, token_data: data.TokenData) -> float:
    losses = [eval_step(params, setup.batch("val", i, token_data)) for i in range(setup.cfgs.train.eval_batches)]
    return float(np.mean(jax.device_get(losses)))


def summarize(rows: list[dict], start: int, predicted_step_s: float, say) -> dict:
    timed = [r for r in rows if r["step"] > start + 1] or rows  # the first step pays for warm-up
    summary = {
        "steps": rows[-1]["step"],
        "first_loss": rows[0]["loss"],
        "final_loss": rows[-1]["loss"],
        "val_loss": rows[-1].get("val_loss"),
        "step_time_s": float(np.median([r["step_time_s"] for r in timed])),
        "predicted_step_time_s": predicted_step_s,
    }
    summary["tokens_per_s"] = float(np.median([r["tokens_per_s"] for r in timed]))
    summary["tflops_per_device"] = float(np.median([r["tflops_per_device"] for r in timed]))
    say(f"done: step {summary['steps']}, loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"
        + (f", val {summary['val_loss']:.3f}" if summary["val_loss"] is not None else "")
        + f"; {summary['step_time_s'] * 1e3:.0f} ms/step, {summary['tokens_per_s']:,.0f} tokens/s, "
        f"{summary['tflops_per_device']:.3g} TFLOPS/device (Megatron formula); "
        f"the plan predicted {predicted_step_s * 1e3:.0f} ms/step")
    return summary


def main(argv: list[str]) -> int:
    cfgs = load_configs(argv)
    # Before any backend starts: jax.distributed for several processes, the CPU device count.
    distributed.initialize(cfgs.parallel.cpu_devices)
    run(cfgs)
    return 0


if __name__ == "__main__":
    cli.run(main)
