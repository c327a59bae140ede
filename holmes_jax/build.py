"""Everything a run builds before its first step: the plan, the mesh, the model, the pipeline, the
optimizer, the shardings of the train state, and the jitted train and eval steps."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from holmes_jax import data, distributed, export, metrics, planning
from holmes_jax.config import ConfigError
from holmes_jax.configure import Configs
from holmes_jax.mesh.devices import build_mesh, host_names, local_topology, ordered_devices
from holmes_jax.models import gpt
from holmes_jax.optimizer import make_optimizer
from holmes_jax.pipeline.runtime import Pipeline, map_blocks
from holmes_jax.pipeline.update import make_settle, make_update
from holmes_jax.planning import Plan
from holmes_jax.planning.communicators import cross_cluster_hops
from holmes_jax.planning.measured import Profile
from holmes_jax.sharding import canonical_shardings, gradient_specs, pending_shapes, pending_specs, state_shardings


def peak_tflops(devices) -> tuple[float, str]:
    """Dense peak TFLOP/s of one device and where the figure comes from: the listed peak of its
    kind, else measured once (CPUs, unlisted GPUs)."""
    kind = devices[0].device_kind
    peak = metrics.device_peak_tflops(kind)
    if peak is not None:
        return peak, f"{kind} dense bf16 peak"
    peak = _measured_peak(tuple(sorted(devices, key=lambda d: d.id)))  # the plan's order or the mesh's: one figure
    return peak, f"measured float32 matmul peak of {kind} ({peak:.3g} TFLOPS/device)"


@functools.lru_cache(maxsize=None)
def _measured_peak(devices: tuple) -> float:
    """The median over processes of what each measures: the figure prices the plan (the emulated
    topology's device speed), and every process must make the same plan."""
    peak = metrics.measure_matmul_peak_tflops(list(devices))
    return float(np.median([float(text) for text in distributed.every_process("peak", repr(peak))]))


def make_plan(cfgs: Configs, devices, process_hosts=None) -> Plan:
    """The Plan for this run: the topology file's, or one emulated from the devices present (on
    `process_hosts`: each process's host name, see mesh.devices.host_names)."""
    par = cfgs.parallel
    if par.profile:
        _check_profile_device(par.profile, sorted({d.device_kind for d in devices}))
    if par.topology:
        topo = planning.load_topology(par.topology)
    else:
        topo = local_topology(devices, device_tflops=peak_tflops(devices)[0], process_hosts=process_hosts)
    return planning.plan(topo, cfgs.model, par, global_batch=cfgs.data.global_batch, seq_len=cfgs.data.seq_len)


def _check_profile_device(path: str, kinds: list[str]) -> None:
    """A profile's layer times are its device's: another kind's would size every stage wrongly."""
    measured = Profile.load(path, "ParallelConfig.profile").device_kind
    if measured not in kinds:
        named = " and ".join(map(repr, kinds))
        raise ConfigError(f"ParallelConfig.profile {path!r} was measured on {measured!r}, but this run's devices "
                          f"are {named}; allowed: a profile measured on them (python -m holmes_jax.profile on this "
                          f"run's devices), or no profile (ParallelConfig.profile = None)")


@dataclasses.dataclass
class Setup:
    """Everything a run builds before its first step. The train state holds block parameters (and
    their optimizer moments) in the pipeline's staged layout, and with ZeRO-1 the updates that the
    next step's `settle` gathers (`pending`, pipeline.update); checkpoints hold the canonical
    layout, the updates settled."""

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
    pending_shapes: dict  # the train state's `pending`

    @functools.cached_property
    def settle(self):
        """`settle(params, pending) -> params` (pipeline.update), for use inside `jit`."""
        return make_settle(self.pipeline, self.specs, self.grad_specs)

    @property
    def specs(self) -> dict:
        return jax.tree.map(lambda s: s.spec, self.state_shardings)

    def _with_nothing_pending(self, state: dict) -> dict:
        return dict(state, pending=jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.pending_shapes))

    def _canonical_state(self, params: dict | None = None) -> dict:
        params = self.model.init(self.cfgs.train.seed) if params is None else params
        return {"params": params, "opt_state": self.tx.init(params), "step": jnp.zeros((), jnp.int32)}

    @functools.cached_property
    def _between_layouts(self) -> dict:
        """Where a state passes between the canonical and the staged layout: staged, each block
        leaf split over `data` where the canonical splits it over `stage` and `data` together,
        so each change of layout is one all-to-all over `stage`. Left to XLA, it gathered whole
        leaves on every device (a resume's temporaries were the whole model)."""
        def staged(sharding):
            dims = [None if d == "stage" else "data" if d == ("stage", "data") else d for d in sharding.spec]
            return NamedSharding(self.mesh, P("stage", *dims))

        return map_blocks(staged, self.canonical_shardings)

    def _staged_state(self, canonical: dict) -> dict:
        staged = jax.lax.with_sharding_constraint(self.pipeline.to_staged(canonical), self._between_layouts)
        return self._with_nothing_pending(staged)

    def _fresh_state(self, params: dict | None = None) -> dict:
        # spread as a checkpoint's state is: left to XLA, each device made the whole model first
        return self._staged_state(jax.lax.with_sharding_constraint(self._canonical_state(params),
                                                                   self.canonical_shardings))

    # The jitted programs below are made once per Setup: a new `jax.jit` of a new function traces
    # and compiles again on every call (a profile starts many fresh states, a run saves often).
    @functools.cached_property
    def _jitted_fresh_state(self):
        return jax.jit(self._fresh_state, out_shardings=self.state_shardings)

    def init_state(self) -> dict:
        params, folder = None, self.cfgs.model.init_from
        if folder:  # a Hugging Face model's weights, as global arrays (a process reads its devices' parts)
            params = export.import_hf(folder, self.cfgs.model, self.canonical_shardings["params"])
        return self._jitted_fresh_state(params)

    @functools.cached_property
    def _jitted_settle(self):
        return jax.jit(self.settle, out_shardings=self.state_shardings["params"])

    def settled(self, state: dict) -> dict:
        """The train state with its pending updates added and `pending` dropped (staged layout),
        the parameters the next step computes with; run at every eval. Only the parameters go
        through the (once jitted) program: the optimizer state is the state's own, not a copy of
        the moments made on every eval."""
        return {"params": self._jitted_settle(state["params"], state["pending"]), "opt_state": state["opt_state"],
                "step": state["step"]}

    @functools.cached_property
    def canonical(self):
        """`canonical(state)`: what a checkpoint stores, the updates settled, real layers only, in
        model order; jitted once, run at every save. Each replica adds the pending updates of its
        own shard (`settle`'s all-gather would put a stage's whole parameters on every device
        first; the sums are the same, element by element), then one all-to-all over `stage`
        spreads them as the canonical layout is."""
        spread = map_blocks(lambda s: NamedSharding(self.mesh, P(None, *s.spec)), self.canonical_shardings)

        def canonical(state):
            # pending is (0,) for a leaf ZeRO-1 does not split: nothing waits there
            params = jax.tree.map(lambda p, u: p + u.astype(p.dtype) if u.shape == p.shape else p,
                                  state["params"], state["pending"])
            settled = {"params": params, "opt_state": state["opt_state"], "step": state["step"]}
            on_shards = jax.lax.with_sharding_constraint(settled, self._between_layouts)
            return self.pipeline.to_canonical(jax.lax.with_sharding_constraint(on_shards, spread))

        return jax.jit(canonical, out_shardings=self.canonical_shardings)

    @functools.cached_property
    def staged(self):
        """`staged(canonical)`: the train state of a canonical one (a restored checkpoint)."""
        return jax.jit(self._staged_state, out_shardings=self.state_shardings)

    def abstract_canonical(self) -> dict:
        return _abstract(self._canonical_state, self.canonical_shardings)

    def abstract_state(self) -> dict:
        """The train state's shapes and shardings: enough to compile the step without making one."""
        return _abstract(self._fresh_state, self.state_shardings)

    def batch(self, split: str, step: int, token_data: data.TokenData) -> jax.Array:
        """The global batch of `step` (a pure function of seed and step), as (microbatches,
        microbatch rows, seq + 1). A process reads from disk only the rows its own devices hold,
        once for all its devices that hold them (stages and tensor shards)."""
        d = self.cfgs.data
        m = self.plan.microbatches
        shape = (m, d.global_batch // m, d.seq_len + 1)
        read = {}

        def shard(index):
            micro, rows = range(m)[index[0]], range(shape[1])[index[1]]
            key = (micro, rows)
            if key not in read:
                wanted = [i * shape[1] + r for i in micro for r in rows]
                tokens = token_data.batch(split, self.cfgs.train.seed, step, d.global_batch, d.seq_len, wanted)
                read[key] = tokens.reshape(len(micro), len(rows), shape[2])
            return read[key][:, :, index[2]]

        return jax.make_array_from_callback(shape, self.batch_sharding, shard)


def _abstract(make, shardings) -> dict:
    """What `make()` returns, as shapes with `shardings`, computed without allocating it."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), jax.eval_shape(make),
                        shardings)


def build(cfgs: Configs, devices=None) -> Setup:
    devices = ordered_devices(devices)
    gpt.check_attention(cfgs.model, devices[0])
    hosts = host_names()  # exchanged once: the emulated topology and the mesh's placement read them
    the_plan = make_plan(cfgs, devices, hosts)
    mesh = build_mesh(the_plan, devices=devices, process_hosts=hosts)
    par = cfgs.parallel
    model = gpt.GPT(cfgs.model)
    pipeline = Pipeline(model, mesh, the_plan.stage_layers, the_plan.microbatches, the_plan.schedule,
                        cross_cluster_hops(the_plan.topology, the_plan.grid), par.grad_reduce_dtype)
    tx, schedule = make_optimizer(cfgs.train)
    canonical = jax.eval_shape(lambda: model.init(0))
    staged = jax.eval_shape(pipeline.to_staged, canonical)
    grad_specs = gradient_specs(staged, "stage", mesh.shape["data"], par.zero1, mesh.shape["tensor"])
    shardings = state_shardings(mesh, tx, staged, "stage", par.zero1)
    shardings["pending"] = jax.tree.map(lambda spec: NamedSharding(mesh, spec), pending_specs(grad_specs),
                                        is_leaf=lambda x: isinstance(x, P))
    return Setup(cfgs, the_plan, mesh, model, pipeline, tx, schedule, shardings,
                 canonical_shardings(mesh, tx, canonical), grad_specs,
                 NamedSharding(mesh, P(None, "data", None)),
                 pending_shapes(staged, grad_specs, jnp.dtype(par.update_gather_dtype)))


def make_train_step(setup: Setup):
    """The jitted step: the last step's updates settled (ZeRO-1), the pipeline's loss and
    gradients over all microbatches, one AdamW update of each stage's real layers. A step whose
    loss or gradient norm is not finite keeps the old parameters and optimizer state and pends
    nothing (`skipped` in its outputs) but still counts: `step` numbers batches, so a resumed run
    lines up."""
    pipeline = setup.pipeline
    update = make_update(pipeline, setup.tx, setup.cfgs.train.grad_clip, setup.specs, setup.grad_specs,
                         gather_dtype=setup.cfgs.parallel.update_gather_dtype)

    def step(state, batch):
        params = setup.settle(state["params"], state["pending"])
        loss, grads = pipeline.loss_and_grads(params, batch, setup.grad_specs)
        new_params, pending, opt_state, norm, applied = update(params, state["opt_state"], grads, loss)
        keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(applied, new, old))
        new_state = {"params": new_params, "pending": keep(pending, jax.tree.map(jnp.zeros_like, pending)),
                     "opt_state": keep(opt_state, state["opt_state"]), "step": state["step"] + 1}
        return new_state, {"loss": loss, "grad_norm": norm, "skipped": ~applied}

    return jax.jit(step, in_shardings=(setup.state_shardings, setup.batch_sharding),
                   out_shardings=(setup.state_shardings, None), donate_argnums=0)


def make_eval_step(setup: Setup):
    """Validation loss of a batch through the same pipeline program, of settled parameters
    (`Setup.settled`). It also runs the backward (its gradients are dropped): simpler than a
    second forward-only schedule, and evaluation is rare."""
    return jax.jit(lambda params, batch: setup.pipeline.loss_and_grads(params, batch, setup.grad_specs)[0],
                   in_shardings=(setup.state_shardings["params"], setup.batch_sharding))
