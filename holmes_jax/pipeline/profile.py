"""Profiles that size the partition from measurements instead of typed-in ratios.

- Layer costs: XLA's flop count of one transformer block (`cost_analysis`) and its measured
  forward and forward+backward time on the real device, for one microbatch, per layer.
- The optimizer step: the parameters of one stage's blocks through the run's optimizer (AdamW,
  clipping), timed on the real device, as seconds per parameter.
- Links: bandwidth and latency of each stage's data-parallel group (a `psum` over `data` on that
  stage's devices) and of each stage boundary (a `ppermute` from stage s to s + 1), each timed at
  two message sizes so latency and bandwidth separate: t = latency + bytes / bandwidth (for the
  ring all-reduce the bytes are 2(n - 1)/n of the buffer).

Everything is timed as the step runs it, not at its best: compute over a whole stage's stack of
layers (a one-layer stack compiles to faster straight-line code than the layer loop a stage
runs), every data group's sync at once, and each measurement on all processes at once, each
repeat started together, the median repeat kept. Stages compute and sync in lockstep, and
processes that share CPU cores (as on the emulated testbed) or a link slow each other down; a
lone best-case run hides that.

`python -m holmes_jax.pipeline.profile --out profile.json [--gin.NAME=VALUE ...]` writes the JSON
that `python -m holmes_jax.plan --profile` and `ParallelConfig.profile` read.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from holmes_jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Link:
    gbps: float
    latency_s: float


@dataclasses.dataclass(frozen=True)
class Profile:
    device_kind: str
    micro_batch: int
    seq_len: int
    layer_fwd_flops: float  # XLA's count for one block, one microbatch
    layer_fwd_s: float
    layer_bwd_s: float
    data_links: tuple[Link | None, ...]  # per stage; None when the stage has one replica
    stage_links: tuple[Link, ...]  # per boundary s -> s + 1
    update_s_per_param: float = 0.0  # the optimizer step (older profiles lack it: not timed)

    @property
    def achieved_tflops(self) -> float:
        """What one device sustains on a block's forward (its efficiency folded in)."""
        return self.layer_fwd_flops / self.layer_fwd_s / 1e12

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            raw = json.loads(Path(path).read_text())
            raw["data_links"] = tuple(Link(**l) if l else None for l in raw["data_links"])
            raw["stage_links"] = tuple(Link(**l) for l in raw["stage_links"])
            return cls(**raw)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"--profile {path}: not a readable holmes_jax profile ({e})") from None


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


def profile_layer(model, blocks, micro_batch: int, seq_len: int, repeats: int = 5) -> tuple[float, float, float]:
    """(XLA forward flops, forward seconds, backward seconds) per block, timed over `blocks` (a
    stage's stack, on one device)."""
    device = jax.tree.leaves(blocks)[0].device
    layers = jax.tree.leaves(blocks)[0].shape[0]
    dtype = jnp.dtype(model.cfg.compute_dtype)
    x = jax.device_put(jnp.ones((micro_batch, seq_len, model.cfg.hidden), dtype), device)
    fwd = jax.jit(model.blocks)
    step = jax.jit(jax.grad(lambda p, x: jnp.sum(model.blocks(p, x).astype(jnp.float32)), argnums=(0, 1)))
    one = jax.tree.map(lambda x: x[:1], blocks)
    flops = float(fwd.lower(one, x).compile().cost_analysis()["flops"])
    t_fwd = _lockstep_time(fwd, blocks, x, repeats=repeats) / layers
    t_both = _lockstep_time(step, blocks, x, repeats=repeats) / layers
    return flops, t_fwd, max(t_both - t_fwd, 0.0)


def profile_update(tx, blocks, repeats: int = 5) -> float:
    """Seconds per parameter of one optimizer step (update and apply) over `blocks`."""
    grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), blocks)
    state = tx.init(blocks)

    @jax.jit
    def update(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    count = sum(x.size for x in jax.tree.leaves(blocks))
    return _lockstep_time(update, blocks, grads, state, repeats=repeats) / count


def _fit(sizes: list[int], times: list[float], factor: float) -> Link:
    """t = latency + factor * bytes / bandwidth, from two sizes."""
    (s0, s1), (t0, t1) = sizes, times
    per_byte = max((t1 - t0) / (factor * (s1 - s0)), 1e-15)
    return Link(gbps=8.0 / per_byte / 1e9, latency_s=max(t0 - factor * s0 * per_byte, 0.0))


def _whole_mesh(fn, mesh: Mesh, size: int):
    """`fn` over every device of `mesh`, each holding a `size`-byte buffer."""
    spec = P(*mesh.axis_names)
    x = jax.device_put(jnp.ones(tuple(mesh.shape.values()) + (size // 4,), jnp.float32), NamedSharding(mesh, spec))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)), x


def profile_data_groups(mesh: Mesh, sizes=(1 << 16, 1 << 22), repeats: int = 5) -> list[Link | None]:
    """Each stage's data-parallel group, from a `psum` over `data` that every group runs at once
    (as the step's gradient sync does); a process times its own groups. Per stage: this
    process's measurement where it holds a device of that stage, else None (see `_share_links`)."""
    n, stages = mesh.shape["data"], mesh.shape["stage"]
    if n < 2:
        return [None] * stages
    times = []
    for size in sizes:
        reduce, x = _whole_mesh(lambda x: jax.lax.psum(x, "data"), mesh, size)
        times.append(_lockstep_time(reduce, x, repeats=repeats))
    link = _fit(list(sizes), times, 2 * (n - 1) / n)
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


def _share_links(links: list, group_sizes: list[int]) -> list:
    """Every process's measured links merged: per stage, the median over the processes that
    measured it (a stage's group is measured by its own processes)."""
    mine = np.array([[l.gbps, l.latency_s] if l else [np.nan, np.nan] for l in links], dtype=np.float64)
    every = _median_over_processes(mine)
    return [Link(float(every[s, 0]), float(every[s, 1])) if n > 1 and not np.isnan(every[s, 0]) else None
            for s, n in enumerate(group_sizes)]


def profile(model, tx, mesh: Mesh, micro_batch: int, seq_len: int, stage_layers: int = 1,
            repeats: int = 5) -> Profile:
    """Profiles the layer and the optimizer `tx` (over a stage of `stage_layers` blocks) on each
    process's first device (the median over processes), and every link of `mesh` (stage, data,
    tensor)."""
    device = mesh.local_devices[0]
    blocks = jax.device_put(jax.tree.map(lambda x: x[:stage_layers], model.init(0)["blocks"]), device)
    flops, t_fwd, t_bwd = profile_layer(model, blocks, micro_batch, seq_len, repeats)
    update = profile_update(tx, blocks, repeats)
    t_fwd, t_bwd, update = (float(v) for v in _median_over_processes(np.array([t_fwd, t_bwd, update])))
    stages = mesh.shape["stage"]
    # each process measured its own stages' groups: share them
    data_links = _share_links(profile_data_groups(mesh, repeats=repeats), [mesh.shape["data"]] * stages)
    stage_links = tuple(profile_stage_boundary(mesh, s, repeats=repeats) for s in range(stages - 1))
    return Profile(device.device_kind, micro_batch, seq_len, flops, t_fwd, t_bwd, tuple(data_links), stage_links,
                   update)


def main(argv: list[str]) -> int:
    import argparse

    from holmes_jax import train
    from holmes_jax.models import gpt

    parser = argparse.ArgumentParser(prog="python -m holmes_jax.pipeline.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write the profile JSON")
    parser.add_argument("--repeats", type=int, default=5)
    args, gin_args = parser.parse_known_args(argv)
    cfgs = train.load_configs(gin_args)
    from holmes_jax import distributed

    # Before any backend starts: jax.distributed for several processes (as train does), the CPU device count.
    distributed.initialize(cfgs.parallel.cpu_devices)
    devices = train.ordered_devices()
    run_plan = train.make_plan(cfgs, devices)
    mesh = run_plan.build_mesh(devices)
    dp = mesh.shape["data"]
    micro_batch = cfgs.data.global_batch // (dp * cfgs.parallel.microbatches)
    tx, _ = train.make_optimizer(cfgs.train)
    result = profile(gpt.GPT(cfgs.model), tx, mesh, micro_batch, cfgs.data.seq_len, max(run_plan.stage_layers),
                     args.repeats)
    if jax.process_index() == 0:
        Path(args.out).write_text(result.to_json())
        print(result.to_json())
    return 0


if __name__ == "__main__":
    from holmes_jax import cli

    cli.run(main)
