"""Profiles that size the partition from measurements instead of typed-in ratios.

- Layer costs: XLA's flop count of one transformer block (`cost_analysis`) and its measured
  forward and forward+backward time on the real devices (all at once, each call synced over
  `stage` as a pipeline tick is), for one microbatch, per layer.
- Stage speeds: each stage's layers timed without waiting for the others, relative to the
  slowest stage (devices that differ in speed: a throttled cluster).
- The optimizer step as the run takes it (clipping, AdamW), over the whole mesh with the run's
  shardings (ZeRO-1: each device its share), as seconds per parameter a device updates.
- Links: bandwidth and latency of each stage's data-parallel group (the sync the step runs over
  `data` on that stage's devices: a `psum`, or with ZeRO-1 a reduce-scatter and an all-gather)
  and of each stage boundary (a `ppermute` from stage s to s + 1), each timed at two message
  sizes so latency and bandwidth separate: t = latency + bytes / bandwidth (for the ring
  all-reduce, or the pair, the bytes are 2(n - 1)/n of the buffer).
- Whole steps: the real train step of the profiled layout (mesh, schedule, microbatches) on the
  model cut to a quarter and to three quarters of the profiled stage's layers per stage, each the
  median of its steps over two interleaved rounds (`PROBE_ROUNDS`: both depths, then both again,
  so that the machine's drift falls on both alike). Planning fits to them what the parts above
  leave out (a factor on compute, a fixed part a step; planning.search). The depths are not the
  profiled model's, so its own step stays a prediction.
- Timed splits (`--splits N`, default none): the profiled model's own step at the N splits that
  the plan, from everything above, ranks fastest on this layout (its `auto` split and those one
  layer away), timed in rounds as the whole steps are. Planning's `auto` then takes the fastest
  measured: where the cost model ranks splits within a few percent of each other, a few compiles
  of the whole model settle it, unless the host is noisier than that (a split's rounds further
  apart than the two fastest splits): the profile then warns.

Everything is timed as the step runs it, not at its best: compute over a whole stage's stack of
layers (a one-layer stack compiles to faster straight-line code than the layer loop a stage
runs), every data group's sync at once, and each measurement on all processes at once, each
repeat started together, the median repeat kept. Stages compute and sync in lockstep, and
processes that share CPU cores (as on the emulated testbed) or a link slow each other down; a
lone best-case run hides that.

`python -m holmes_jax.profile --out profile.json [--splits N] [--gin.NAME=VALUE ...]` writes the JSON
(also to stdout; its progress goes to stderr) that `python -m holmes_jax.plan --profile` and `ParallelConfig.profile` read (the run's own
ParallelConfig.profile, if set, is not read: this profile replaces it). Its keys:
`device_kind`, `compute_dtype`, `remat`, `block` (what was measured: the devices, the model's
dtype, remat and block shape); `micro_batch`, `seq_len` (the microbatch timed); `layer_fwd_flops`,
`layer_fwd_s`, `layer_bwd_s` (one block on one microbatch: XLA's forward flops, forward seconds,
backward seconds); `stage_layer_scale` (per stage, its layer time over the slowest stage's; empty,
and not timed, with one stage or where a stage has no process that holds it alone);
`update_s_per_param`; `data_links` (per stage, null with one replica) and `stage_links` (per
boundary), each `gbps`, `bytes_per_s`, `latency_s`; `step_probes` and `split_probes` (the whole
steps and timed splits: `stage_layers`, `dp`, `tp`, `microbatches`, `schedule`, `step_s`, the
median step in seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from holmes_jax import build, cli, configure, data, distributed, planning, train
from holmes_jax.config import ConfigError
from holmes_jax.models import gpt
from holmes_jax.pipeline import warmup
from holmes_jax.pipeline.update import make_update
from holmes_jax.planning.measured import Profile, StepProbe, block_shape
from holmes_jax.planning.topology import Link


def _lockstep_time(fn, *args, repeats: int, min_repeat_s: float = 0.1) -> float:
    """Median seconds of `fn(*args)`, every process starting each repeat together. A repeat runs
    `fn` back to back for at least `min_repeat_s` (the same count on every process), so the
    processes overlap for most of it, as the stages do through a pipeline step."""
    jax.block_until_ready(fn(*args))  # compile and warm up
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls = int(np.ceil(min_repeat_s / max(time.perf_counter() - t, 1e-6)))
    if jax.process_count() > 1:
        calls = int(multihost_utils.broadcast_one_to_all(np.int32(calls)))
    times = []
    for r in range(repeats):
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"holmes_jax.profile repeat {r}")
        t = time.perf_counter()
        for _ in range(calls):  # one at a time: CPU collectives in flight together can deadlock
            jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) / calls)
    return float(np.median(times))


def _per_device(mesh: Mesh, shape: tuple, dtype=jnp.float32) -> jax.Array:
    """Ones of `shape` on every device of `mesh`, the mesh's dims leading (split one per device)."""
    return jax.device_put(jnp.ones(tuple(mesh.shape.values()) + tuple(shape), dtype),
                          NamedSharding(mesh, P(*mesh.axis_names)))


def _stage_stack(model, mesh: Mesh, layers: int) -> dict:
    """A stack of `layers` initialised blocks on every device of `mesh`, from a model of that
    depth: the whole model's init would first make every layer on one device, more than the run
    (which splits them over stages) may hold there."""
    stack = gpt.GPT(dataclasses.replace(model.cfg, num_layers=layers)).init(0)["blocks"]
    return jax.device_put(stack, NamedSharding(mesh, P()))


def profile_layer(model, mesh: Mesh, layers: int, micro_batch: int, seq_len: int,
                  repeats: int = 5) -> tuple[float, float, float]:
    """(XLA forward flops, forward seconds, backward seconds) per block, timed over a stage's stack
    of `layers` blocks on every device of `mesh` at once. Each call ends with a one-number `psum`
    over `stage`, the sync a pipeline tick's ppermute makes: a tick lasts as long as the slower
    stage of each pair, so that is what is timed (the psum's own time, measured alone, taken off)."""
    blocks = _stage_stack(model, mesh, layers)
    spec = P(*mesh.axis_names)
    dtype = jnp.dtype(model.cfg.compute_dtype)
    x = _per_device(mesh, (micro_batch, seq_len, model.cfg.hidden), dtype)
    lead, first = (None,) * len(mesh.axis_names), (0,) * len(mesh.axis_names)  # the mesh dims of a local block

    def synced(y):  # y, after every stage of its pipeline has computed its own
        return (y + 0 * jax.lax.psum(y.ravel()[0], "stage"))[lead]

    def forward(b, x):
        return synced(model.blocks(b, x[first]))

    def backward(b, x):
        loss = lambda b, x: jnp.sum(model.blocks(b, x).astype(jnp.float32))  # noqa: E731
        g_blocks, g_x = jax.grad(loss, argnums=(0, 1))(b, x[first])
        return synced(g_x), jax.tree.map(lambda g: g[lead], g_blocks)

    def sync_only(b, x):
        return synced(x[first])

    def over_mesh(fn, out_specs):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), spec), out_specs=out_specs, check_vma=False))

    one = jax.eval_shape(lambda: jax.tree.map(lambda v: v[:1], blocks))  # one block's shapes
    local_x = jax.ShapeDtypeStruct((micro_batch, seq_len, model.cfg.hidden), dtype)
    flops = float(jax.jit(model.blocks).lower(one, local_x).compile().cost_analysis()["flops"])
    t_sync = _lockstep_time(over_mesh(sync_only, spec), blocks, x, repeats=repeats)
    t_fwd = _lockstep_time(over_mesh(forward, spec), blocks, x, repeats=repeats) - t_sync
    t_both = _lockstep_time(over_mesh(backward, (spec, jax.tree.map(lambda _: spec, blocks))), blocks, x,
                            repeats=repeats) - t_sync
    return flops, max(t_fwd, 1e-9) / layers, max(t_both - t_fwd, 0.0) / layers


def _stage_processes(mesh: Mesh) -> dict[int, set[int]]:
    """The stages each process holds devices of (the mesh lists every process's devices)."""
    held: dict[int, set[int]] = {}
    for s in range(mesh.shape["stage"]):
        for d in mesh.devices[s].flat:
            held.setdefault(d.process_index, set()).add(s)
    return held


def stage_speeds_timed(mesh: Mesh) -> bool:
    """Whether `profile_stage_scale` can time each stage: more than one, and each held alone by
    some process (a process holding several would time them together). Every process decides the
    same from the mesh."""
    alone = {next(iter(stages)) for stages in _stage_processes(mesh).values() if len(stages) == 1}
    return mesh.shape["stage"] > 1 and len(alone) == mesh.shape["stage"]


def profile_stage_scale(model, mesh: Mesh, layers: int, micro_batch: int, seq_len: int,
                        repeats: int = 5) -> tuple[float, ...]:
    """Per stage, its layers' forward + backward time over the slowest stage's, every device at
    once but none waiting for another (a tick waits for the slowest, so `profile_layer` times
    that one). Empty, and nothing timed, where `stage_speeds_timed` says no (one stage, or a
    stage whose every process holds several: its time would be theirs together)."""
    if not stage_speeds_timed(mesh):  # the result would be empty: no compile, no timing for nothing
        return ()
    stages = mesh.shape["stage"]
    mine = _stage_processes(mesh).get(jax.process_index(), set())
    blocks = _stage_stack(model, mesh, layers)
    spec = P(*mesh.axis_names)
    x = _per_device(mesh, (micro_batch, seq_len, model.cfg.hidden), jnp.dtype(model.cfg.compute_dtype))
    lead, first = (None,) * len(mesh.axis_names), (0,) * len(mesh.axis_names)

    def both(b, x):
        loss = lambda b, x: jnp.sum(model.blocks(b, x).astype(jnp.float32))  # noqa: E731
        return jax.grad(loss, argnums=1)(b, x[first])[lead]

    fn = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(P(), spec), out_specs=spec, check_vma=False))
    t = _lockstep_time(fn, blocks, x, repeats=repeats)
    times = _median_over_processes(np.array([t if s in mine and len(mine) == 1 else np.nan for s in range(stages)]))
    return tuple(float(v) for v in times / times.max())


def profile_update(setup, repeats: int = 5) -> float:
    """Seconds per parameter a device of the deepest stage updates in one optimizer step as the
    run takes it (`pipeline.update`: clipping's global norm, AdamW on each stage's real layers),
    over the whole mesh with gradients and optimizer state sharded as the run shards them (ZeRO-1:
    each device its 1/dp share). The updates stay sharded like the gradients (`pending`):
    gathering them is the data link's part of the sync."""
    state = setup.init_state()
    shardings = setup.state_shardings
    grad_shardings = jax.tree.map(lambda spec: NamedSharding(setup.mesh, spec), setup.grad_specs,
                                  is_leaf=lambda x: isinstance(x, P))
    grads = jax.jit(lambda p: jax.tree.map(lambda x: jnp.full_like(x, 1e-3), p), out_shardings=grad_shardings)(
        state["params"])

    update = make_update(setup.pipeline, setup.tx, setup.cfgs.train.grad_clip, setup.specs, setup.grad_specs,
                         gather_dtype=setup.cfgs.parallel.update_gather_dtype)
    finite = jnp.zeros((), jnp.float32)  # a loss the update applies
    step = jax.jit(lambda params, opt_state, grads: update(params, opt_state, grads, finite)[1:3],
                   in_shardings=(shardings["params"], shardings["opt_state"], grad_shardings),
                   out_shardings=(shardings["pending"], shardings["opt_state"]))
    # The step over the whole mesh lasts as long as the deepest stage's (the others skip their
    # padding): per device of that stage, its share of every leaf with all `max_layers` block slots.
    device = setup.mesh.local_devices[0]
    count = sum(next(s for s in x.addressable_shards if s.device == device).data.size for x in jax.tree.leaves(grads))
    return _lockstep_time(step, state["params"], state["opt_state"], grads, repeats=repeats) / count


def probe_depths(stage_layers: tuple[int, ...]) -> tuple[int, int]:
    """Layers per stage of the two step probes: a quarter and three quarters of the longest stage
    (at least 1 and 2). Spanning most of the stage, the fit interpolates towards its depth rather
    than extrapolating from shallow steps, which multiplies their timing error."""
    deepest = max(stage_layers)
    return max(1, deepest // 4), max(2, 3 * deepest // 4)


PROBE_ROUNDS = 2  # each probe timed in this many interleaved rounds (A B, A B): the machine drifts over minutes


def _compile_step(setup, stage_layers: tuple[int, ...], token_data: data.TokenData):
    """`setup`'s layout (mesh, schedule, microbatches, placement) on its model with `stage_layers`
    layers per stage: the run and its compiled train step, with the step's communicators across
    clusters opened."""
    plan, cfgs = setup.plan, setup.cfgs
    probe = dataclasses.replace(
        cfgs, model=dataclasses.replace(cfgs.model, num_layers=sum(stage_layers), init_from=None),
        parallel=dataclasses.replace(cfgs.parallel, pp=plan.pp, dp=plan.dp, tp=plan.tp, stage_layers=tuple(stage_layers),
                                     microbatches=plan.microbatches, schedule=plan.schedule, profile=None))
    run = build.build(probe, list(setup.mesh.devices.flat))
    compiled = build.make_train_step(run).lower(run.abstract_state(), run.batch("train", 0, token_data)).compile()
    warmup.warm_up(run, compiled.as_text(), say=lambda *a: None)
    return run, compiled


def _time_steps(run, compiled, token_data: data.TokenData, steps: int, warmup_steps: int) -> list[float]:
    """Seconds of each of `steps` train steps from a fresh state, after `warmup_steps` untimed
    ones: the trainer's own loop (`train.train_steps`, a fresh batch each step, each step's
    outputs fetched), timed as its metrics time it."""
    times, t = [], time.perf_counter()
    for step, _, _ in train.train_steps(compiled, run, run.init_state(), 0, warmup_steps + steps, token_data):
        if step == warmup_steps and jax.process_count() > 1:  # the timed steps start together
            multihost_utils.sync_global_devices(f"holmes_jax.profile steps {list(run.pipeline.stage_layers)}")
        times.append(time.perf_counter() - t)
        t = time.perf_counter()
    return times[warmup_steps:]


def profile_steps(setup, layouts: list[tuple[int, ...]], token_data: data.TokenData, rounds: int = PROBE_ROUNDS,
                  steps: int = 12, warmup_steps: int = 3, say=lambda *a: None) -> list[StepProbe]:
    """The step of `setup`'s layout with each of `layouts` (layers per stage): each compiled once,
    then timed in `rounds` interleaved rounds (every layout, then every layout again), each time
    `steps` steps from a fresh state after `warmup_steps`, so that the machine's drift over those
    minutes falls on every layout alike; the median of the pooled steps (median over processes).
    Only one state is alive at a time."""
    compiled = []
    for i, layers in enumerate(layouts):  # each compiles the model at that depth: say how far it is
        compiled.append(_compile_step(setup, layers, token_data))
        say(f"profile: compiled {i + 1}/{len(layouts)} {list(layers)}")
    pooled: list[list[float]] = [[] for _ in layouts]
    by_round: list[list[float]] = [[] for _ in layouts]  # each round's median step, this process's
    for r in range(rounds):
        for i, (run, step) in enumerate(compiled):
            times = _time_steps(run, step, token_data, steps, warmup_steps)
            pooled[i] += times
            by_round[i].append(float(np.median(times)))
            say(f"profile: round {r + 1}/{rounds} {list(layouts[i])}: {by_round[i][-1] * 1e3:.0f} ms a step")
    mine = [float(np.median(times)) for times in pooled]  # this process's
    noise = _noisier_than_apart(layouts, by_round, mine)
    if noise:
        say(noise)
    medians = _median_over_processes(np.array(mine))
    plan = setup.plan
    return [StepProbe(tuple(layers), plan.dp, plan.tp, plan.microbatches, plan.schedule, float(s))
            for layers, s in zip(layouts, medians)]


def _noisier_than_apart(layouts, by_round: list[list[float]], medians: list[float]) -> str | None:
    """A warning where one layout's rounds differ more than the two fastest layouts do: their
    order (the split `auto` takes from timed splits) is then the host's noise. On the emulated
    testbed's shared cores one split's rounds once took 1995 and 1338 ms while the three splits'
    medians lay within 6%."""
    if len(layouts) < 2 or len(by_round[0]) < 2:
        return None
    spread = [max(r) / min(r) - 1 for r in by_round]
    first, second = sorted(medians)[:2]
    apart, worst = second / first - 1, int(np.argmax(spread))
    if spread[worst] <= apart:
        return None
    rounds_ms = ", ".join(f"{t * 1e3:.0f}" for t in by_round[worst])
    # one decimal: whole percents said "differed by 2% ... more than ... (2%)"
    return (f"profile: warning: the rounds of {list(layouts[worst])} differed by {spread[worst]:.1%} ({rounds_ms} ms), "
            f"more than the two fastest layouts differ ({apart:.1%}): on this host their order is noise; "
            f"profile again at a quieter time")


def ranked_splits(setup, prof: Profile, count: int) -> list[tuple[int, ...]]:
    """The `count` splits of the profiled model that the plan, from `prof`, predicts fastest on
    `setup`'s layout: `auto`'s own and those one layer away from it (a layer moved between two
    stages), fastest first."""
    plan, cfgs = setup.plan, setup.cfgs
    par = dataclasses.replace(cfgs.parallel, pp=plan.pp, dp=plan.dp, tp=plan.tp, microbatches=plan.microbatches,
                              schedule=plan.schedule, partition="auto", stage_layers=None, profile=None)

    def predict(stage_layers=None):
        return planning.plan(plan.topology, cfgs.model, dataclasses.replace(par, stage_layers=stage_layers),
                             global_batch=cfgs.data.global_batch, seq_len=cfgs.data.seq_len, profile=prof)

    best = predict().stage_layers
    near = {best}
    for a, b in itertools.permutations(range(len(best)), 2):
        moved = list(best)
        moved[a], moved[b] = moved[a] + 1, moved[b] - 1
        if moved[b] >= 1:
            near.add(tuple(moved))
    return sorted(near, key=lambda s: (predict(s).prediction.step_time_s, s))[:count]


def _fit(sizes: list[int], times: list[float], factor: float) -> Link:
    """t = latency + factor * bytes / bandwidth, from two sizes."""
    (s0, s1), (t0, t1) = sizes, times
    per_byte = max((t1 - t0) / (factor * (s1 - s0)), 1e-15)
    return Link(1.0 / per_byte, max(t0 - factor * s0 * per_byte, 0.0))


def _whole_mesh(fn, mesh: Mesh, size: int):
    """`fn` over every device of `mesh`, each holding a `size`-byte buffer."""
    spec = P(*mesh.axis_names)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)), _per_device(mesh, (size // 4,))


def profile_data_groups(mesh: Mesh, zero1: bool, sizes=(1 << 16, 1 << 22), repeats: int = 5) -> list[Link | None]:
    """Each stage's data-parallel group, from the sync the step runs over `data` (a `psum`, or
    with ZeRO-1 a reduce-scatter and then an all-gather: the same bytes as a ring all-reduce),
    every group at once; a process times its own groups. Per stage: this process's measurement
    where it holds a device of that stage, else None (see `_share_links`)."""
    n, stages = mesh.shape["data"], mesh.shape["stage"]
    if n < 2:
        return [None] * stages

    def sync(x):
        if not zero1:
            return jax.lax.psum(x, "data")
        shard = jax.lax.psum_scatter(x, "data", scatter_dimension=x.ndim - 1, tiled=True)
        return jax.lax.all_gather(shard, "data", axis=x.ndim - 1, tiled=True)

    sizes = [size // (4 * n) * 4 * n for size in sizes]  # float32s that split evenly over the group (ZeRO-1)
    times = []
    for size in sizes:
        reduce, x = _whole_mesh(sync, mesh, size)
        times.append(_lockstep_time(reduce, x, repeats=repeats))
    link = _fit(sizes, times, 2 * (n - 1) / n)
    return [link if any(d.process_index == jax.process_index() for d in mesh.devices[s].flat) else None
            for s in range(stages)]


def profile_stage_boundary(mesh: Mesh, stage: int, sizes=(1 << 16, 1 << 22), repeats: int = 5) -> Link:
    """A `ppermute` of each data/tensor position's buffer from `stage` to `stage + 1`."""
    times = []
    for size in sizes:
        shift, x = _whole_mesh(lambda x: jax.lax.ppermute(x, "stage", [(stage, stage + 1)]), mesh, size)
        times.append(_lockstep_time(shift, x, repeats=repeats))
    return _fit(list(sizes), times, 1.0)


def _median_over_processes(values: np.ndarray) -> np.ndarray:
    """The median of every process's `values` (NaN: not measured there), element by element."""
    if jax.process_count() == 1:
        return values
    every = np.asarray(multihost_utils.process_allgather(np.asarray(values, np.float32)), np.float64)
    return np.nanmedian(every, axis=0)


def _share_links(links: list) -> tuple:
    """Every process's measured links merged, so that every process holds the same profile (and
    ranks the same splits to time): each the median over the processes that measured it (None:
    not measured there), None where none did."""
    if not links:
        return ()
    mine = np.array([[l.bytes_per_s, l.latency_s] if l else [np.nan, np.nan] for l in links], dtype=np.float64)
    return tuple(None if np.isnan(b) else Link(float(b), float(t)) for b, t in _median_over_processes(mine))


def profile(setup, repeats: int = 5, splits: int = 0, say=print) -> Profile:
    """Profiles the run that `setup` (a `build.Setup`) builds: the layer over a stage's stack of
    blocks and the optimizer step, each over the whole mesh (medians over processes), every link
    of the mesh (stage, data), whole steps of its layout at two depths and, with `splits` > 0,
    the model's own step at the `splits` splits that the rest of the profile ranks fastest."""
    mesh, model, cfgs = setup.mesh, setup.model, setup.cfgs
    micro_batch = setup.plan.micro_batch
    stages, deepest = mesh.shape["stage"], max(setup.pipeline.stage_layers)
    depths = probe_depths(setup.pipeline.stage_layers)
    # Each part compiles and times for seconds (minutes on a large model): say which one runs, and of how many.
    # a part with nothing to time says so, rather than seem to time it
    one_stage = ": skipped, one stage" if stages == 1 else ""
    speeds = one_stage or ("" if stage_speeds_timed(mesh) else ": skipped, a process holds several stages")
    syncs = "" if mesh.shape["data"] > 1 else ": skipped, one replica a stage"
    parts = [f"a stage's {deepest} layer(s), forward and backward", f"each stage's speed{speeds}",
             "the optimizer step", f"the data groups' sync{syncs}", f"the links between stages{one_stage}",
             f"whole steps at {depths[0]} and {depths[1]} layers a stage"]
    parts += [f"the model's own step at the {splits} splits ranked fastest"] if splits > 0 else []

    def measuring(part: int) -> None:
        say(f"profile: {part + 1}/{len(parts)} timing {parts[part]}")

    measuring(0)
    flops, t_fwd, t_bwd = profile_layer(model, mesh, deepest, micro_batch, cfgs.data.seq_len, repeats)
    measuring(1)
    scale = profile_stage_scale(model, mesh, deepest, micro_batch, cfgs.data.seq_len, repeats)
    measuring(2)
    update = profile_update(setup, repeats)
    t_fwd, t_bwd, update = (float(v) for v in _median_over_processes(np.array([t_fwd, t_bwd, update])))
    # each process measured its own stages' groups and its own side of each boundary: share them
    measuring(3)
    data_links = (_share_links(profile_data_groups(mesh, cfgs.parallel.zero1, repeats=repeats))
                  if mesh.shape["data"] > 1 else (None,) * stages)  # no group anywhere: nothing to share
    measuring(4)
    stage_links = _share_links([profile_stage_boundary(mesh, s, repeats=repeats) for s in range(stages - 1)])
    measuring(5)
    token_data = data.load(cfgs.data)  # the run's own batches, loaded once for both depths
    probes = tuple(profile_steps(setup, [(n,) * stages for n in depths], token_data, say=say))
    result = Profile(mesh.local_devices[0].device_kind, micro_batch, cfgs.data.seq_len, flops, t_fwd, t_bwd,
                     data_links, stage_links, update, scale, probes, compute_dtype=cfgs.model.compute_dtype,
                     remat=cfgs.model.remat, block=block_shape(setup.plan.model))
    if splits > 0:
        ranked = ranked_splits(setup, result, splits) if stages > 1 else []
        if len(ranked) > 1:
            if len(ranked) < splits:  # it said "the 5 splits" and timed 3
                parts[6] = (f"the model's own step at the {len(ranked)} splits ranked fastest (of {splits} asked: "
                            f"this layout has no more one layer from auto's)")
            measuring(6)
            timed = profile_steps(setup, ranked, token_data, say=say)
            result = dataclasses.replace(result, split_probes=tuple(timed))
        else:  # planning's auto takes the fastest of two or more timed splits: one would cost a compile for nothing
            say(f"profile: --splits {splits} skipped: {list(setup.pipeline.stage_layers)} is this layout's only split")
    return result


def main(argv: list[str]) -> int:
    parser = cli.Parser(prog="python -m holmes_jax.profile", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="The run to profile is configured as train's is (python -m holmes_jax.train --help):\n"
                               "--gin_file FILE, --gin.NAME=VALUE, --no_default_gin.")
    parser.add_argument("--out", required=True, type=cli.path,
                        help="where to write the profile JSON (an earlier profile there is replaced)")
    parser.add_argument("--repeats", type=cli.positive_int, default=5,  # 0 would write a profile of NaNs
                        help="timed repeats of each measurement, the median kept (default 5)")
    parser.add_argument("--splits", default="0",  # checked below, to say what is allowed
                        help="also time the model's own step at this many splits the plan ranks fastest (each "
                             "compiles the whole model); planning's `auto` then takes the fastest of them "
                             "(default 0: none; else 2 or more)")
    args, gin_args = parser.parse_known_args(argv)
    # one timed split has nothing to be faster than; isdecimal: isdigit() took '²', which int() refuses
    if not args.splits.isdecimal() or int(args.splits) == 1:
        parser.error(f"--splits {args.splits} is not allowed; allowed: 0 (none), or 2 or more (auto takes the "
                     f"fastest of them)")
    splits = int(args.splits)
    try:
        cfgs = configure.load_configs(gin_args)
    except ConfigError as e:  # what argparse left over: it may be a misspelt flag of ours, not of gin's
        if str(e).startswith("unknown argument"):
            raise ConfigError(f"{e}, --out, --repeats, --splits") from None
        raise
    # Before any backend starts: jax.distributed for several processes (as train does), the CPU device count.
    distributed.initialize(cfgs.parallel.cpu_devices)
    distributed.check_same_settings(configure.operative_config(cfgs))  # else ranks would wait on each other for ever
    # Before minutes of profiling, not after. Only process 0 writes the profile, so its verdict on
    # --out is every process's (the folder may exist on its host alone).
    verdict = distributed.every_process("profile --out", _out_problem(args.out) if jax.process_index() == 0 else "")
    if verdict[0]:
        parser.error(verdict[0])
    # Progress on stderr, the profile alone on stdout: `... > profile.json` is clean JSON too.
    say = functools.partial(print, file=sys.stderr) if jax.process_index() == 0 else (lambda *a: None)
    if cfgs.parallel.profile:
        # The profile measured here replaces it: one not written yet, or of the model before a change,
        # must not stop its own measurement. (The layout measured is planned without it.)
        say(f"profile: ParallelConfig.profile {cfgs.parallel.profile!r} is not read: this measures the run without it")
        cfgs = dataclasses.replace(cfgs, parallel=dataclasses.replace(cfgs.parallel, profile=None))
    if cfgs.model.init_from:  # weights time as any others: reading a whole Hugging Face model would only wait
        cfgs = dataclasses.replace(cfgs, model=dataclasses.replace(cfgs.model, init_from=None))
    result = profile(build.build(cfgs), args.repeats, splits, say)
    if jax.process_index() == 0:
        try:
            cli.replace_file(Path(args.out), result.to_json())
        except OSError as e:  # minutes of measurement: print them rather than lose them
            print(result.to_json())
            raise cli.RunError(f"--out {args.out!r} cannot be written: {e.strerror or e}; the profile is "
                               f"on stdout") from None
        print(result.to_json())
    return 0


def _out_problem(arg: str) -> str:
    """Why `--out arg` cannot take the profile, or ''."""
    out = Path(arg)
    if not arg or out.is_dir() or not out.parent.is_dir():
        return f"--out {arg!r} is not allowed; allowed: a file in an existing folder"
    # written in place where it is no plain file (/dev/null), so that needs writing, not its folder (/dev)
    if not os.access(out if out.exists() and not out.is_file() else out.parent, os.W_OK):
        return f"--out {arg!r} is not allowed: its folder is not writable; allowed: a file in a folder you may write"
    if not _replaceable(out):  # a slip of the command line (--out my_run.gin) would lose that file
        return f"--out {arg!r} exists and is not a profile; remove it or choose another"
    return ""


def _replaceable(out: Path) -> bool:
    """Whether `--out` may be overwritten: new, empty, not a plain file (/dev/null) or an earlier profile."""
    if not out.is_file() or out.stat().st_size == 0:
        return True
    if out.stat().st_size > 1 << 24:  # a profile is kilobytes: no need to read a data file to know
        return False
    try:
        raw = json.loads(out.read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: brackets nested too deep
        return False
    return isinstance(raw, dict) and "layer_fwd_s" in raw


if __name__ == "__main__":
    cli.run(main)
