"""`holmes_jax.plan(topology, model, parallel)` and `python -m holmes_jax.plan`: topology + model -> Plan.

The Plan is all train needs from planning: the (pp, dp, tp) device grid and mesh sizes, layers
per stage, schedule and microbatches, and the predicted step. Sizes left to the planner (tp, pp,
dp, microbatches, schedule) are searched: every layout that fits the topology, the model, the
batch and device memory is screened with a cheap split (the time-balanced one for `auto`),
simulated in the order of its lower bound until no bound can win, and the best few get the full
partition search. Predictions come from holmes_jax.pipeline.cost; TFLOPS use Megatron's formula
(holmes_jax.metrics.megatron_flops), the recompute variant when the model's remat policy is 'full'.

With a measured profile (`profile=`, `--profile FILE`, `ParallelConfig.profile`; written by
`python -m holmes_jax.pipeline.profile`) the cost model uses measured numbers instead of the
topology's defaults (see `_with_profile`):

- Layers: the profile's forward and backward seconds of one block. When the plan's micro batch or
  sequence differ from the profile's, they are scaled by the analytic layer FLOPs of the two shapes
  (attention's s^2 term included). Embedding and head keep their analytic FLOPs, run at the
  forward's measured rate. The measurement is of the profile's device (topology device 0); other
  clusters' stages are scaled by their `device_tflops * device_efficiency` relative to it.
- The optimizer step: the profile's seconds per parameter (without a profile it is not timed).
- Links: the profile's data-group all-reduce and stage-boundary figures, matched to the plan's
  stages by index, replace the topology's where measured. They are ignored (with a note) when the
  plan's pp differs from the profile's. Measure a profile on the layout it will plan (placement,
  dp); a profile with no links (`data_links = []`, `stage_links = []`) sizes layers only.

Every such choice is listed in `Plan.notes` (printed by `explain()`, in the JSON as `notes`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import types
from typing import Iterable, Mapping

import numpy as np

from holmes_jax import cli
from holmes_jax.config import ConfigError, ModelConfig, ParallelConfig
from holmes_jax.mesh import planner
from holmes_jax.mesh.planner import PLACEMENTS, Placement, Route
from holmes_jax.mesh.topology import Topology, load
from holmes_jax.metrics import megatron_flops
from holmes_jax.models import presets
from holmes_jax.pipeline import cost, partition
from holmes_jax.pipeline.cost import SCHEDULES, CostModel, Prediction

SEARCHABLE = ("tp", "pp", "dp", "microbatches", "schedule")
DEFAULT_GLOBAL_BATCH = 512  # sequences: with seq 2048, 1M tokens a step, GPT-3-sized batches
FULL_SEARCH = 3  # screened layouts that get the full partition search
# Microbatch counts the search tries: from pp (fewer leave most of the pipeline idle and save no
# memory) to 32 per stage (past that the bubble is under 3% while each microbatch adds fixed
# latencies), at most 512 (keeps the schedule simulation quick).
MAX_MICROBATCHES_PER_STAGE, MAX_MICROBATCHES = 32, 512
FLOPS_FORMULA = {
    True: "Megatron with recompute: 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))",
    False: "Megatron without recompute: 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))",
}


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    topology: Topology
    model: ModelConfig  # resolved
    placement: Placement  # the device grid, its clusters and NIC classes, the links it uses
    stage_layers: tuple[int, ...]
    partition: str  # the method behind stage_layers; "explicit" when they were given
    schedule: str
    microbatches: int
    global_batch: int
    seq_len: int
    zero1: bool
    prediction: Prediction
    partitions: Mapping[str, Prediction]  # every partition method's split on this layout
    notes: tuple[str, ...] = ()  # how a measured profile was used (or why parts of it were not)

    @property
    def grid(self) -> np.ndarray:
        """(pp, dp, tp) topology device numbers."""
        return self.placement.grid

    @property
    def mesh(self) -> dict[str, int]:
        return dict(zip(planner.AXES, self.grid.shape))

    @property
    def pp(self) -> int:
        return self.grid.shape[0]

    @property
    def dp(self) -> int:
        return self.grid.shape[1]

    @property
    def tp(self) -> int:
        return self.grid.shape[2]

    @property
    def micro_batch(self) -> int:
        return self.global_batch // (self.dp * self.microbatches)

    @property
    def flops_formula(self) -> str:
        return FLOPS_FORMULA[self.model.remat == "full"]

    def build_mesh(self, devices=None, process_nics=None):
        """The jax Mesh (stage, data, tensor) of this plan on real devices (see mesh.planner.build_mesh)."""
        return planner.build_mesh(self.grid, self.topology, devices, process_nics)

    def to_dict(self) -> dict:
        pl = self.placement
        return {
            "model": self.model.preset, "model_config": dataclasses.asdict(self.model),
            "topology": self.topology.to_dict(), "devices": int(self.grid.size),
            "mesh": self.mesh, "placement": pl.method, "schedule": self.schedule,
            "microbatches": self.microbatches, "micro_batch": self.micro_batch,
            "global_batch": self.global_batch, "seq_len": self.seq_len, "zero1": self.zero1,
            "partition": self.partition, "stage_layers": list(self.stage_layers),
            "stage_clusters": list(pl.stage_clusters), "stage_nic": list(pl.stage_nic),
            "data_groups_nic": [list(g) for g in pl.data_groups_nic], "mixed_stages": list(pl.mixed_stages),
            "links": {"tensor": [_route_dict(r) for r in pl.tensor_routes],
                      "data": [_route_dict(r) for r in pl.data_routes],
                      "boundaries": [_route_dict(r) for r in pl.boundary_routes]},
            "predicted": dict(self.prediction.to_dict(), flops_formula=self.flops_formula),
            "partitions": {m: {"stage_layers": list(p.stage_layers), "step_time_s": p.step_time_s, "fits": p.fits}
                           for m, p in self.partitions.items()},
            "device_grid": self.grid.tolist(),
            "notes": list(self.notes),
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def explain(self) -> str:
        """A readable table: stages, their cluster and NIC, layers, times, links, the predicted step."""
        pl, pr, m = self.placement, self.prediction, self.model
        lines = [
            f"plan: {m.preset} ({m.num_layers} layers, hidden {m.hidden}, {m.compute_dtype}"
            f"{'' if m.remat == 'none' else f', remat {m.remat}'}) on topology {self.topology.name!r}: {self.grid.size} devices, "
            f"{len(self.topology.clusters)} cluster(s)",
            f"mesh stage={self.pp} data={self.dp} tensor={self.tp} | placement {pl.method} | schedule {self.schedule}, "
            f"{self.microbatches} microbatches of {self.micro_batch} "
            f"(global batch {self.global_batch}, seq {self.seq_len})"
            f" | partition {self.partition}",
            "",
            _table(["stage", "cluster", "nic", "layers", "fwd+bwd/mb", "compute", "sync", "update", "finish", "memory",
                    "gradient ring"],
                   [[s, pl.stage_clusters[s], pl.stage_nic[s], self.stage_layers[s],
                     _seconds(pr.stage_fwd_s[s] + pr.stage_bwd_s[s]), _seconds(pr.stage_compute_s[s]),
                     _seconds(pr.stage_sync_s[s]), _seconds(pr.stage_update_s[s]), _seconds(pr.stage_finish_s[s]),
                     f"{_bytes(pr.stage_memory_bytes[s])} of {_bytes(pl.device_memory[s])}",
                     _route_text(pl.data_routes[s]) if self.dp > 1 else "-"] for s in range(self.pp)]),
        ]
        if self.pp > 1:
            lines += ["", _table(["boundary", "activations cross", "per microbatch, each way"],
                                 [[f"{s} -> {s + 1}", _route_text(r), _seconds(pr.p2p_s[s])]
                                  for s, r in enumerate(pl.boundary_routes)])]
        if pl.mixed_stages:
            lines += ["", "stages spanning clusters: " + "; ".join(
                f"{s} ({pl.stage_clusters[s]}, data groups {'+'.join(pl.data_groups_nic[s])})"
                for s in pl.mixed_stages)]
        lines += [
            "",
            f"predicted step {_seconds(pr.step_time_s)} | {pr.samples_per_s:.4g} samples/s | "
            f"{pr.tflops_per_device:.4g} TFLOPS/device ({self.flops_formula})",
            "partitions on this layout: " + " | ".join(
                f"{name} {','.join(map(str, p.stage_layers))} {_seconds(p.step_time_s)}"
                f"{'' if p.fits else ' (over memory)'}"
                for name, p in self.partitions.items()),
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _route_dict(r: Route) -> dict:
    return {"via": r.via, "gbps_per_transfer": r.bytes_per_s * 8 / 1e9, "latency_us": round(r.latency_s * 1e6, 6),
            "shared_by": r.shared_by}


def _route_text(r: Route) -> str:
    shared = f", {r.shared_by} share a NIC" if r.shared_by > 1 else ""
    return f"{r.via}: {r.bytes_per_s * 8 / 1e9:.3g} Gb/s each{shared}"


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 or s == 0 else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _bytes(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def _table(header: list, rows: list[list]) -> str:
    cells = [[str(c) for c in row] for row in [header] + rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


# ----------------------------------------------------------------------------- planning


def _cost_model(cfg: ModelConfig, pl: Placement, global_batch: int, seq_len: int, microbatches: int,
                schedule: str, zero1: bool, prof=None, topo: Topology | None = None,
                notes: list[str] | None = None) -> CostModel:
    pp, dp, tp = pl.grid.shape
    micro_batch = global_batch // (dp * microbatches)
    costs = presets.model_costs(cfg, micro_batch, seq_len)

    def link(r: Route) -> cost.Link:
        return cost.Link(r.bytes_per_s, r.latency_s)

    layers, device_flops = costs.layers, list(pl.device_flops)
    update = [0.0] * pp  # the optimizer step is only timed by a profile
    dp_links, boundaries = [link(r) for r in pl.data_routes], [link(r) for r in pl.boundary_routes]
    if prof is not None:
        layers, device_flops, update, dp_links, boundaries = _with_profile(
            prof, cfg, costs, micro_batch, seq_len, pl, topo, dp_links, boundaries, notes if notes is not None else [])
    work = cost.Work(costs.embed, layers, costs.head, costs.activation_bytes,
                     tp_allreduces_bwd=4 if cfg.remat == "full" else 2, layer_stash_bytes=_stash_bytes(cfg, costs, tp, seq_len),
                     sync_collectives=costs.param_leaves)
    stages = [cost.Stage(device_flops[s], tp, link(pl.tensor_routes[s]), dp, dp_links[s],
                         pl.device_memory[s], update[s]) for s in range(pp)]
    flops = megatron_flops(global_batch, seq_len, cfg.num_layers, cfg.hidden, cfg.vocab_size, cfg.remat)
    return CostModel(work, stages, boundaries, microbatches, schedule, zero1,
                     step_flops=flops, samples=global_batch)


def _load_profile(profile, cfg: ModelConfig):
    """A checked Profile from a Profile, a JSON path or None."""
    if profile is None:
        return None
    from holmes_jax.pipeline.profile import Profile  # imports jax: only when a profile is used

    prof = Profile.load(profile) if isinstance(profile, (str, os.PathLike)) else profile
    if not isinstance(prof, Profile):
        raise ConfigError(f"profile = {profile!r} is not allowed; allowed: a profile JSON path or a Profile")
    where = f"profile {str(profile)!r}" if isinstance(profile, (str, os.PathLike)) else "profile"
    for name in ("micro_batch", "seq_len"):
        value = getattr(prof, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: {name} = {value!r} is not allowed; allowed: a positive integer")
    for name, low in (("layer_fwd_flops", 0.0), ("layer_fwd_s", 0.0)):
        value = getattr(prof, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > low:
            raise ConfigError(f"{where}: {name} = {value!r} is not allowed; allowed: a positive number")
    if not isinstance(prof.layer_bwd_s, (int, float)) or isinstance(prof.layer_bwd_s, bool) or prof.layer_bwd_s < 0:
        raise ConfigError(f"{where}: layer_bwd_s = {prof.layer_bwd_s!r} is not allowed; allowed: a number >= 0")
    for kind, links in (("data_links", prof.data_links), ("stage_links", prof.stage_links)):
        for i, l in enumerate(links):
            if l is None:
                continue
            if not (isinstance(l.gbps, (int, float)) and l.gbps > 0 and isinstance(l.latency_s, (int, float))
                    and l.latency_s >= 0):
                raise ConfigError(f"{where}: {kind}[{i}] = {l!r} is not allowed; allowed: gbps > 0, latency_s >= 0")
    # A profile of another model: XLA's count of its block is far from this model's analytic one.
    analytic = presets.model_costs(cfg, prof.micro_batch, prof.seq_len).layers[0].fwd_flops
    if not 0.5 <= prof.layer_fwd_flops / analytic <= 2.0:
        raise ConfigError(f"{where}: its layer has {prof.layer_fwd_flops:.4g} forward FLOPs at micro batch "
                          f"{prof.micro_batch}, seq {prof.seq_len}, but model {cfg.preset!r} (hidden {cfg.hidden}, "
                          f"ffn {cfg.ffn_hidden}) has {analytic:.4g}; allowed: a profile of this model")
    return prof


def _with_profile(prof, cfg: ModelConfig, costs: presets.ModelCosts, micro_batch: int, seq_len: int,
                  pl: Placement, topo: Topology, dp_links: list, boundaries: list, notes: list[str]):
    """(layers, device FLOP/s per stage, optimizer seconds per parameter per stage, data links,
    boundary links) with the profile's measurements.

    The cost model divides FLOPs by a device rate, so measured seconds enter as a rate: the
    analytic forward FLOPs of a layer at the profile's shape over its measured forward seconds.
    Each layer's backward FLOPs become its forward FLOPs times the measured backward/forward ratio,
    so forward and backward each take their measured time (scaled by FLOPs to the plan's shape).
    """
    pp, dp, _ = pl.grid.shape
    ref = presets.model_costs(cfg, prof.micro_batch, prof.seq_len).layers[0].fwd_flops
    rate = ref / prof.layer_fwd_s  # analytic FLOP/s the profiled device reached
    ratio = prof.layer_bwd_s / prof.layer_fwd_s
    layers = tuple(cost.Part(l.params, l.fwd_flops, l.fwd_flops * ratio) for l in costs.layers)
    own = topo.clusters[int(topo.device_cluster[0])].device_flops  # the profile ran on device 0
    device_flops = [rate * f / own for f in pl.device_flops]
    update = [prof.update_s_per_param * own / f for f in pl.device_flops]  # other devices: by their speed
    shape = f"micro batch {prof.micro_batch} x seq {prof.seq_len}"
    if (prof.micro_batch, prof.seq_len) != (micro_batch, seq_len):
        scale = costs.layers[0].fwd_flops / ref
        notes.append(f"profile: layer times measured at {shape}, scaled by analytic FLOPs x{scale:.3g} to this "
                     f"plan's micro batch {micro_batch} x seq {seq_len}")
    else:
        notes.append(f"profile: layer times measured at {shape} (this plan's): forward "
                     f"{prof.layer_fwd_s * 1e3:.3g} ms, backward {prof.layer_bwd_s * 1e3:.3g} ms")
    if any(f != own for f in pl.device_flops):
        notes.append("profile: stages on other device types scaled by their device_tflops * device_efficiency")
    if len(prof.data_links) == pp:
        used = []
        for s, l in enumerate(prof.data_links):
            if l is not None and dp > 1:
                # The profile fits one fixed cost per all-reduce; the cost model counts 2(n - 1) hops.
                dp_links[s] = cost.Link(l.gbps * 1e9 / 8, l.latency_s / (2 * (dp - 1)))
                used.append(s)
        if used:
            notes.append(f"profile: measured data-group links for stage(s) {', '.join(map(str, used))}")
    elif prof.data_links:
        notes.append(f"profile: its {len(prof.data_links)} data-group links ignored (this plan has pp = {pp}); "
                     f"topology figures used")
    if pp > 1 and len(prof.stage_links) == pp - 1:
        boundaries = [cost.Link(l.gbps * 1e9 / 8, l.latency_s) for l in prof.stage_links]
        notes.append("profile: measured stage-boundary links")
    elif prof.stage_links:
        notes.append(f"profile: its {len(prof.stage_links)} stage-boundary links ignored (this plan has pp = {pp}); "
                     f"topology figures used")
    return layers, device_flops, update, dp_links, boundaries


def _stash_bytes(cfg: ModelConfig, costs: presets.ModelCosts, tp: int, seq_len: int) -> float:
    """Activations one layer keeps per in-flight microbatch on one device, by remat policy: 'full'
    its input; 'dots' its input, the attention projection's output and the column-parallel
    matmuls' outputs (q, k, v, the MLP's first one(s)), split over tp; 'none' Korthikanti et
    al.'s s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes (16-bit activations, tensor parallel without
    sequence parallelism), scaled to the compute dtype: an estimate, the runtime keeps what JAX's
    autodiff saves."""
    h, f = cfg.hidden, cfg.ffn_hidden
    if cfg.remat == "full":
        return costs.activation_bytes
    if cfg.remat == "dots":
        return costs.activation_bytes * (2 + (3 * h + (2 if cfg.mlp == "swiglu" else 1) * f) / (h * tp))
    a = cfg.num_heads
    return costs.activation_bytes / 2 * (10 + 24 / tp + 5 * a * seq_len / (h * tp))


def _stage_ratios(topology: Topology, pl: Placement, ratios: Mapping[str, float] | None) -> list[float]:
    """holmes-ratio's weight per stage: `ratios[cluster name]`, by default the cluster's NIC Gb/s;
    a stage spanning clusters takes the smallest."""
    weights = []
    for s in range(pl.grid.shape[0]):
        clusters = [topology.clusters[c] for c in np.unique(topology.device_cluster[pl.grid[s]])]
        if ratios is not None:
            missing = [c.name for c in clusters if c.name not in ratios]
            if missing:
                raise ConfigError(f"ratios = {dict(ratios)} is not allowed; allowed: a weight for every cluster "
                                  f"({', '.join(c.name for c in topology.clusters)}); missing {', '.join(missing)}")
        weights.append(min(ratios[c.name] if ratios is not None else c.nic_link.gbps for c in clusters))
    return weights


def _layouts(topology: Topology, cfg: ModelConfig, par: ParallelConfig, free: set) -> Iterable[tuple]:
    """(tp, pp, dp) candidates: the fixed values, and for free ones every divisor that could fit."""
    n = topology.num_devices
    node = math.gcd(*(c.devices_per_node for c in topology.clusters))
    tps = ([t for t in planner.divisors(node) if cfg.num_heads % t == 0 and cfg.ffn_hidden % t == 0]
           if "tp" in free else [par.tp])
    dp = None if "dp" in free else par.dp
    for tp in tps:
        if "pp" not in free:
            yield tp, par.pp, dp
        elif dp is not None:
            yield tp, max(n // (tp * dp), 1), dp
        else:
            yield from ((tp, pp, None) for pp in planner.divisors(n // tp) if pp <= cfg.num_layers)


def _check_model(cfg: ModelConfig, tp: int, pp: int) -> None:
    if cfg.num_heads % tp or cfg.ffn_hidden % tp:
        raise ConfigError(f"tp = {tp} is not allowed: it must divide ModelConfig.num_heads = {cfg.num_heads} and "
                          f"ModelConfig.ffn_hidden = {cfg.ffn_hidden}")
    partition.check_stages(cfg.num_layers, pp)


def _microbatch_options(par: ParallelConfig, free: set, global_batch: int, dp: int, pp: int) -> list[int]:
    if global_batch % dp:
        raise ConfigError(f"global_batch = {global_batch} is not allowed with dp = {dp}: every data replica needs "
                          f"the same samples; allowed: a multiple of {dp}")
    per_replica = global_batch // dp
    if "microbatches" in free:
        cap = min(MAX_MICROBATCHES_PER_STAGE * pp, MAX_MICROBATCHES)
        allowed = [m for m in planner.divisors(per_replica) if m <= cap]
        return [m for m in allowed if m >= pp] or allowed[-1:]
    if per_replica % par.microbatches:
        raise ConfigError(f"microbatches = {par.microbatches} is not allowed: each data replica's {per_replica} "
                          f"samples must split evenly; allowed: a divisor of {per_replica}")
    return [par.microbatches]


def _topology(topology) -> Topology:
    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, (str, os.PathLike)):
        return load(topology)
    raise ConfigError(f"topology = {topology!r} is not allowed; allowed: a TOML file path or a Topology")


def plan(topology, model, parallel: ParallelConfig | None = None, *, global_batch: int = DEFAULT_GLOBAL_BATCH,
         seq_len: int | None = None, auto: Iterable[str] | None = None, allow_mixed: bool = False,
         ratios: Mapping[str, float] | None = None, profile=None) -> Plan:
    """Plans `model` (a preset name or ModelConfig) on `topology` (a TOML path or Topology).

    `parallel` fixes tp, pp, dp (None: what is left), microbatches, the partition method or
    stage_layers, the schedule, placement and zero1. `auto` names the sizes of SEARCHABLE that the
    cost model chooses instead; default: all of them without `parallel`, none with it.
    `allow_mixed`: let a holmes stage span clusters (reported) instead of refusing.
    `ratios`: holmes-ratio's weight per cluster name (default: cluster NIC Gb/s).
    `profile`: a measured Profile (or its JSON path); None: `parallel.profile`, else analytic costs
    and topology links (see the module doc).
    """
    topo = _topology(topology)
    cfg = presets.resolve(model if isinstance(model, ModelConfig) else ModelConfig(preset=model))
    par = ParallelConfig() if parallel is None else parallel
    par.validate()
    free = set(SEARCHABLE if parallel is None else ()) if auto is None else set(auto)
    if free - set(SEARCHABLE):
        raise ConfigError(f"auto = {sorted(free)} is not allowed; allowed: any of {', '.join(SEARCHABLE)}")
    if par.stage_layers is not None:
        free.discard("pp")
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    for name, value in (("global_batch", global_batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} = {value!r} is not allowed; allowed: a positive integer")
    if seq_len > cfg.max_seq_len:
        raise ConfigError(f"seq_len = {seq_len} is not allowed; "
                          f"allowed: up to ModelConfig.max_seq_len = {cfg.max_seq_len}")
    prof = _load_profile(par.profile if profile is None else profile, cfg)

    candidates, errors = _candidates(topo, cfg, par, free, global_batch, seq_len, allow_mixed, ratios, prof)
    if not candidates:
        errors = list(dict.fromkeys(errors))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"no layout fits ({len(errors)} kinds of misfit); first: {errors[0]}")
    # Simulate in lower-bound order, stopping once no bound can beat the FULL_SEARCH-th best time.
    timed = []
    for c in sorted(candidates, key=lambda c: c.bound):
        if len(timed) >= FULL_SEARCH and c.bound >= timed[FULL_SEARCH - 1][0]:
            break
        timed = sorted(timed + [(float(c.model.step_times([c.split])[0]), len(timed), c)], key=lambda t: t[:2])
    best = None
    for _, _, c in timed[:FULL_SEARCH]:
        prediction = c.model.predict(partition.split(par.partition, c.model, c.weights, par.stage_layers))
        if best is None or prediction.step_time_s < best[0].step_time_s:
            best = prediction, c
    prediction, c = best
    partitions = {m: c.model.predict(partition.split(m, c.model, c.weights)) for m in partition.METHODS}
    notes: list[str] = []
    if prof is not None:  # the chosen layout's notes (rebuilding its cost model is cheap)
        _cost_model(cfg, c.placement, global_batch, seq_len, c.model.microbatches, c.model.schedule, par.zero1,
                    prof, topo, notes)
    return Plan(topo, cfg, c.placement, prediction.stage_layers,
                "explicit" if par.stage_layers is not None else par.partition, c.model.schedule, c.model.microbatches,
                global_batch, seq_len, par.zero1, prediction, partitions, tuple(notes))


@dataclasses.dataclass(frozen=True, eq=False)
class _Candidate:
    bound: float  # no schedule of this candidate beats it (CostModel.lower_bounds)
    placement: Placement
    model: CostModel
    weights: list[float]  # holmes-ratio's per stage
    split: tuple[int, ...]  # the screening split: time-balanced for auto, else the method's own


def _candidates(topo: Topology, cfg: ModelConfig, par: ParallelConfig, free: set, global_batch: int, seq_len: int,
                allow_mixed: bool, ratios, prof=None) -> tuple[list[_Candidate], list[str]]:
    """Every (layout, microbatches, schedule) that fits the topology, the model, the batch and
    device memory; and why the others do not."""
    found, errors = [], []
    for tp, pp, dp in _layouts(topo, cfg, par, free):
        try:
            _check_model(cfg, tp, pp)
            pl = planner.place(topo, tp, pp, dp, par.placement, allow_mixed)
            options = _microbatch_options(par, free, global_batch, pl.grid.shape[1], pp)
        except ConfigError as e:
            errors.append(str(e))
            continue
        weights = _stage_ratios(topo, pl, ratios)
        for m, schedule in itertools.product(options, SCHEDULES if "schedule" in free else [par.schedule]):
            model = _cost_model(cfg, pl, global_batch, seq_len, m, schedule, par.zero1, prof, topo)
            if par.stage_layers is not None or par.partition != "auto":
                split = partition.split(par.partition, model, weights, par.stage_layers)
            else:
                split = partition.time_balanced(model)
            bound = float(model.lower_bounds([split])[0])
            if bound == np.inf:
                memory = model.stage_terms([split])["memory"][0]
                s = int(np.argmax(memory - np.array(pl.device_memory)))
                errors.append(f"tp = {tp}, pp = {pp}, microbatches = {m}, schedule {schedule} do not fit in device "
                              f"memory: stage {s} needs {memory[s] / 1e9:.3g} GB, its devices have "
                              f"{pl.device_memory[s] / 1e9:.3g} GB; allowed: layouts that fit (or a larger "
                              f"device_memory_gb in the topology)")
                continue
            found.append(_Candidate(bound, pl, model, weights, split))
    return found, errors


# ----------------------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one "error:" line and exit 2 via cli.run, not argparse's usage dump
        raise ConfigError(message)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a positive integer")
    return int(text)


def _layer_list(text: str) -> tuple[int, ...]:
    parts = text.split(",")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: positive layer counts like 26,22")
    return tuple(int(p) for p in parts)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m holmes_jax.plan",
                description="Plan a mesh (stage, data, tensor), layers per stage and a schedule for a model on a "
                            "topology; print the plan and its predicted step time. Sizes left out are chosen by "
                            "the cost model.")
    p.add_argument("--topology", required=True, help="topology TOML file (see configs/topologies)")
    p.add_argument("--model", required=True, help=f"preset: {', '.join(presets.PRESETS)}")
    for name in ("tp", "pp", "dp", "microbatches"):
        p.add_argument(f"--{name}", type=_positive, help="default: chosen by the cost model")
    p.add_argument("--global-batch", type=_positive, default=DEFAULT_GLOBAL_BATCH, help="sequences per step")
    p.add_argument("--seq-len", type=_positive, help="default: the model's max_seq_len")
    p.add_argument("--partition", choices=partition.METHODS, default="auto")
    p.add_argument("--stage-layers", type=_layer_list, help="layers per stage, e.g. 26,22 (wins over --partition)")
    p.add_argument("--placement", choices=PLACEMENTS, default="holmes")
    p.add_argument("--schedule", choices=SCHEDULES, help="default: chosen by the cost model")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="activation dtype")
    p.add_argument("--remat", action="store_true", help="the model recomputes activations in the backward pass")
    p.add_argument("--allow-mixed", action="store_true", help="let a stage span clusters instead of refusing")
    p.add_argument("--profile", help="measured profile JSON (python -m holmes_jax.pipeline.profile) for layer "
                                     "times and link figures instead of the topology's defaults")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    given = {name: getattr(args, name) for name in SEARCHABLE}
    pp = given["pp"] or (len(args.stage_layers) if args.stage_layers else 1)
    parallel = ParallelConfig(tp=given["tp"] or 1, pp=pp, dp=given["dp"], microbatches=given["microbatches"] or 1,
                              stage_layers=args.stage_layers, partition=args.partition,
                              schedule=given["schedule"] or "gpipe", placement=args.placement)
    model = ModelConfig(preset=args.model, compute_dtype=args.dtype, remat=args.remat)
    result = plan(args.topology, model, parallel, global_batch=args.global_batch, seq_len=args.seq_len,
                  auto=[name for name, value in given.items() if value is None], allow_mixed=args.allow_mixed,
                  profile=args.profile)
    print(result.to_json() if args.json else result.explain())
    return 0


class _CallableModule(types.ModuleType):
    """`holmes_jax.plan` is both this module and the function users call; holmes_jax/__init__.py
    returns the module, so the module forwards calls to `plan`."""

    def __call__(self, *args, **kwargs) -> Plan:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    cli.run(main)
