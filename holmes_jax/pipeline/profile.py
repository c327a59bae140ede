"""Profiles that size the partition from measurements instead of typed-in ratios.

- Layer costs: XLA's flop count of one transformer block (`cost_analysis`) and its measured
  forward and forward+backward time on the real device, for one microbatch.
- The optimizer step: one block's parameters through the run's optimizer (AdamW, clipping),
  timed on the real device, as seconds per parameter.
- Links: bandwidth and latency of each stage's data-parallel group (a `psum` over `data` on that
  stage's devices) and of each stage boundary (a `ppermute` from stage s to s + 1), each timed at
  two message sizes so latency and bandwidth separate: t = latency + bytes / bandwidth (for the
  ring all-reduce the bytes are 2(n - 1)/n of the buffer).

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


def _best_time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def profile_layer(model, micro_batch: int, seq_len: int, device, repeats: int = 5) -> tuple[float, float, float]:
    """(XLA forward flops, forward seconds, backward seconds) of one block on `device`."""
    params = jax.device_put(jax.tree.map(lambda x: x[:1], model.init(0)["blocks"]), device)
    dtype = jnp.dtype(model.cfg.compute_dtype)
    x = jax.device_put(jnp.ones((micro_batch, seq_len, model.cfg.hidden), dtype), device)
    fwd = jax.jit(model.blocks)
    step = jax.jit(jax.grad(lambda p, x: jnp.sum(model.blocks(p, x).astype(jnp.float32)), argnums=(0, 1)))
    flops = float(fwd.lower(params, x).compile().cost_analysis()["flops"])
    t_fwd = _best_time(fwd, params, x, repeats=repeats)
    t_both = _best_time(step, params, x, repeats=repeats)
    return flops, t_fwd, max(t_both - t_fwd, 0.0)


def profile_update(model, tx, device, repeats: int = 5) -> float:
    """Seconds per parameter of one optimizer step (update and apply) over one block on `device`."""
    params = jax.device_put(jax.tree.map(lambda x: x[:1], model.init(0)["blocks"]), device)
    grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), params)
    state = jax.device_put(tx.init(params), device)

    @jax.jit
    def update(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    count = sum(x.size for x in jax.tree.leaves(params))
    return _best_time(update, params, grads, state, repeats=repeats) / count


def _fit(sizes: list[int], times: list[float], factor: float) -> Link:
    """t = latency + factor * bytes / bandwidth, from two sizes."""
    (s0, s1), (t0, t1) = sizes, times
    per_byte = max((t1 - t0) / (factor * (s1 - s0)), 1e-15)
    return Link(gbps=8.0 / per_byte / 1e9, latency_s=max(t0 - factor * s0 * per_byte, 0.0))


def profile_data_group(devices, sizes=(1 << 16, 1 << 22), repeats: int = 5) -> Link | None:
    n = len(devices)
    if n < 2:
        return None
    mesh = Mesh(np.asarray(devices), ("data",))
    reduce = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    times = []
    for size in sizes:
        x = jax.device_put(jnp.ones((n, size // 4), jnp.float32), NamedSharding(mesh, P("data")))
        times.append(_best_time(reduce, x, repeats=repeats))
    return _fit(list(sizes), times, 2 * (n - 1) / n)


def profile_stage_boundary(mesh: Mesh, stage: int, sizes=(1 << 16, 1 << 22), repeats: int = 5) -> Link:
    """A `ppermute` of each data/tensor position's buffer from `stage` to `stage + 1`."""
    shift = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "stage", [(stage, stage + 1)]), mesh=mesh,
                                  in_specs=P(*mesh.axis_names), out_specs=P(*mesh.axis_names)))
    times = []
    for size in sizes:
        shape = tuple(mesh.shape.values()) + (size // 4,)
        x = jax.device_put(jnp.ones(shape, jnp.float32), NamedSharding(mesh, P(*mesh.axis_names)))
        times.append(_best_time(shift, x, repeats=repeats))
    return _fit(list(sizes), times, 1.0)


def _share_links(links: list, group_sizes: list[int]) -> list:
    """Every process's measured links merged (a stage's group is measured by its own processes)."""
    from jax.experimental import multihost_utils

    mine = np.array([[l.gbps, l.latency_s] if l else [np.nan, np.nan] for l in links], dtype=np.float64)
    every = np.asarray(multihost_utils.process_allgather(mine))  # (processes, stages, 2)
    merged = []
    for s, n in enumerate(group_sizes):
        rows = every[:, s][~np.isnan(every[:, s, 0])]
        merged.append(Link(float(rows[0, 0]), float(rows[0, 1])) if n > 1 and len(rows) else None)
    return merged


def profile(model, tx, mesh: Mesh, micro_batch: int, seq_len: int, repeats: int = 5) -> Profile:
    """Profiles the layer and the optimizer `tx` on this process's first device and every link of
    `mesh` (stage, data, tensor)."""
    flops, t_fwd, t_bwd = profile_layer(model, micro_batch, seq_len, mesh.local_devices[0], repeats)
    update = profile_update(model, tx, mesh.local_devices[0], repeats)
    grid = mesh.devices
    data_links = []
    for s in range(grid.shape[0]):
        group = list(grid[s, :, 0])  # the data group of tensor rank 0 stands for its stage
        mine = any(d.process_index == jax.process_index() for d in group)
        data_links.append(profile_data_group(group, repeats=repeats) if mine else None)
    if jax.process_count() > 1:  # each process measured its own stages' groups: share them
        data_links = _share_links(data_links, group_sizes=[grid.shape[1]] * grid.shape[0])
    stage_links = tuple(profile_stage_boundary(mesh, s, repeats=repeats) for s in range(grid.shape[0] - 1))
    return Profile(mesh.local_devices[0].device_kind, micro_batch, seq_len, flops, t_fwd, t_bwd,
                   tuple(data_links), stage_links, update)


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
    mesh = train.make_plan(cfgs, devices).build_mesh(devices)
    dp = mesh.shape["data"]
    micro_batch = cfgs.data.global_batch // (dp * cfgs.parallel.microbatches)
    tx, _ = train.make_optimizer(cfgs.train)
    result = profile(gpt.GPT(cfgs.model), tx, mesh, micro_batch, cfgs.data.seq_len, args.repeats)
    if jax.process_index() == 0:
        Path(args.out).write_text(result.to_json())
        print(result.to_json())
    return 0


if __name__ == "__main__":
    from holmes_jax import cli

    cli.run(main)
