"""The search behind `holmes_jax.plan(topology, model, parallel)`: topology + model -> Plan.

Sizes left to the planner (tp, pp, dp, microbatches, schedule) are searched: every layout that
fits the topology, the model, the batch and device memory is screened (for `auto` at every split
where there are few, as its partition search would try them, else at the time-balanced one),
simulated in the order of its lower bound until no bound can win, and the best few get the full
partition search.
Predictions come from holmes_jax.planning.cost; TFLOPS use Megatron's formula
(holmes_jax.planning.workload.megatron_flops), the recompute variant when the model's remat
policy is 'full'.

With a measured profile (`profile=`, `--profile FILE`, `ParallelConfig.profile`; written by
`python -m holmes_jax.profile`) the cost model uses measured numbers instead of the
topology's defaults (see `_with_profile`):

- Layers: the profile's forward and backward seconds of one block. When the plan's micro batch or
  sequence differ from the profile's, they are scaled by the analytic layer FLOPs of the two shapes
  (attention's s^2 term included); the backward likewise when the model's remat differs from the
  profile's. A profile of another compute_dtype is refused. Embedding and head keep their analytic
  FLOPs, run at the forward's measured rate. The measurement is of the profile's device (topology
  device 0); other clusters' stages are scaled by their `device_tflops * device_efficiency`
  relative to it.
- Stage speeds: where the profile timed each stage's layers on its own (`stage_layer_scale`, as
  many stages as the plan's), stage s runs them at that fraction of the (slowest stage's) layer
  times, and its optimizer step likewise, instead of the topology's device ratios.
- The optimizer step: the profile's seconds per parameter (without a profile it is not timed).
- Links: the profile's data-group all-reduce and stage-boundary figures, matched to the plan's
  stages by index, replace the topology's where measured. They are ignored (with a note) when the
  plan's pp differs from the profile's, and the data groups' when its dp or tp differ from the
  profiled mesh's (as its step probes record it). Measure a profile on the layout it will plan
  (placement, dp); a profile with no links (`data_links = []`, `stage_links = []`) sizes layers only.
- Whole steps: the profile times the real train step of its layout on models of two depths
  (`step_probes`, a quarter and three quarters of the profiled stage's layers per stage). The
  model predicts both with the profile's numbers; what they leave unexplained is fitted as a
  factor on compute (the layers as the pipeline runs them, rather than as the profile times a
  stack of them alone) and a fixed part a step (dispatch, buffers, the guard: on CPU devices
  tens of milliseconds, more at a capped CPU), stage s paying it at its measured speed
  (`_fit_step_probes`). Used when the plan's mesh is the probes'; see `Plan.notes`.
- Timed splits (`split_probes`, `python -m holmes_jax.profile --splits N`): the profiled model's
  own step at the N splits the cost model ranked fastest on its layout. Where they are of the
  plan's layout, model, microbatches, schedule, micro batch, sequence and remat, `auto` takes the
  fastest of them: the cost model ranks, the measurement picks among the few it ranks closest. The
  prediction stays the cost model's.

Every such choice is listed in `Plan.notes` (printed by `explain()`, in the JSON as `notes`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from typing import Iterable, Mapping

import numpy as np

from holmes_jax.config import REMAT, WIRE_BYTES, ConfigError, ModelConfig, ParallelConfig, check_positive, is_number
from holmes_jax.models import presets
from holmes_jax.planning import cost, partition, placement, workload
from holmes_jax.planning.cost import SCHEDULES, CostModel
from holmes_jax.planning.measured import Profile, block_shape
from holmes_jax.planning.placement import Placement
from holmes_jax.planning.contract import Plan
from holmes_jax.planning.topology import Link, Topology, from_dict, load

SEARCHABLE = ("tp", "pp", "dp", "microbatches", "schedule")
DEFAULT_GLOBAL_BATCH = 512  # sequences: with seq 2048, 1M tokens a step, GPT-3-sized batches
FULL_SEARCH = 3  # screened layouts that get the full partition search
# Microbatch counts the search tries: from pp (fewer leave most of the pipeline idle and save no
# memory) to 32 per stage (past that the bubble is under 3% while each microbatch adds fixed
# latencies), at most 512 (keeps the schedule simulation quick). A layout that fits memory with none of
# these, or whose time-balanced split does not, tries more, up to 512: smaller micro batches are then
# what makes it (or its faster split) fit.
MAX_MICROBATCHES_PER_STAGE, MAX_MICROBATCHES = 32, 512
# Past these the search takes minutes or all memory (it prices every layer on every stage, and
# walks every tick of the schedule); far above real models (about 100 layers) and runs.
MAX_LAYERS, MAX_GIVEN_MICROBATCHES = 1024, 4096


def _cost_model(cfg: ModelConfig, pl: Placement, global_batch: int, seq_len: int, microbatches: int,
                schedule: str, par: ParallelConfig, prof=None, topo: Topology | None = None) -> tuple[CostModel, tuple[str, ...]]:
    """The cost model of one layout, and notes on how a measured profile entered it."""
    pp, dp, tp = pl.grid.shape
    micro_batch = workload.micro_batch(global_batch, dp, microbatches)
    notes: list[str] = []
    costs = workload.model_costs(cfg, micro_batch, seq_len)

    layers, device_flops = costs.layers, list(pl.device_flops)
    update = [0.0] * pp  # the optimizer step is only timed by a profile
    dp_links, boundaries = list(pl.data_routes), list(pl.boundary_routes)
    if prof is not None:
        layers, device_flops, update, dp_links, boundaries = _with_profile(
            prof, cfg, costs, micro_batch, seq_len, pl, topo, dp_links, boundaries, notes)
    whole = workload.zero1_whole(cfg, dp, tp)
    stash = _stash_bytes(cfg, costs, tp, micro_batch, seq_len)
    work = cost.Work(costs.embed, layers, costs.head, costs.activation_bytes,
                     tp_allreduces_bwd=4 if cfg.remat == "full" else 2, layer_stash_bytes=stash,
                     layer_work_bytes=workload.layer_work_bytes(cfg, micro_batch, seq_len, stash, tp),
                     head_work_bytes=workload.head_work_bytes(cfg, micro_batch, seq_len, tp),
                     sync_collectives=costs.param_leaves, reduce_bytes_per_param=WIRE_BYTES[par.grad_reduce_dtype],
                     gather_bytes_per_param=WIRE_BYTES[par.update_gather_dtype],
                     zero1_whole_layer_share=whole.layer_share, zero1_whole_shared_share=whole.shared_share,
                     zero1_whole_leaves=whole.leaves, vocab_split_params=workload.vocab_split_params(cfg, tp))
    stages = [cost.Stage(device_flops[s], tp, pl.tensor_routes[s], dp, dp_links[s],
                         pl.device_memory[s], update[s]) for s in range(pp)]
    flops = workload.megatron_flops(global_batch, seq_len, cfg.num_layers, cfg.hidden, cfg.vocab_size, cfg.remat)
    model = CostModel(work, stages, boundaries, microbatches, schedule, par.zero1 and dp > 1, step_flops=flops,
                      samples=global_batch)
    if prof is not None and prof.step_probes:
        model = _fit_step_probes(model, prof, cfg, pl, par, topo, notes)
    return model, tuple(notes)


def _fit_step_probes(model: CostModel, prof: Profile, cfg: ModelConfig, pl: Placement, par: ParallelConfig,
                     topo: Topology, notes: list[str]) -> CostModel:
    """`model` with compute scaled and a fixed part a step added so that it predicts the profile's
    measured steps (`step_probes`, least squares over them): each probe's step is the model's with
    no compute (links, the update) plus k times its compute plus f. Stage s pays f times its
    measured speed (`stage_layer_scale`; the probes' lockstep step waits for the slowest). `model`
    as it is, with a note, where the probes are not of this mesh or do not fit."""
    probes = [p for p in prof.step_probes if (len(p.stage_layers), p.dp, p.tp) == tuple(pl.grid.shape)]
    if not probes:
        notes.append(f"profile: its step probes are not of this mesh {tuple(pl.grid.shape)} (stage, data, tensor); "
                     f"not fitted")
        return model
    if len({sum(p.stage_layers) for p in probes}) < 2:
        notes.append(f"profile: its step probes of this mesh time one depth ({sum(probes[0].stage_layers)} layers); "
                     f"a fit needs two; not fitted")
        return model
    plain = dataclasses.replace(prof, step_probes=())
    rows = []
    for p in probes:
        # the probes ran with the profile's remat: predict them with it, not with this model's
        probe_cfg = dataclasses.replace(cfg, num_layers=sum(p.stage_layers), remat=prof.remat or cfg.remat)
        batch = prof.micro_batch * p.microbatches * p.dp
        probe, _ = _cost_model(probe_cfg, pl, batch, prof.seq_len, p.microbatches, p.schedule, par, plain, topo)
        no_compute = probe.with_stages([dataclasses.replace(s, device_flops=math.inf) for s in probe.stages])
        base = no_compute.predict(p.stage_layers).step_time_s
        rows.append((base, probe.predict(p.stage_layers).step_time_s - base, p.step_s))
    base, compute, measured = (np.array(c, dtype=float) for c in zip(*rows))  # an int step_s past int64 too
    probes_text = ", ".join(f"{list(p.stage_layers)} {p.step_s * 1e3:.0f} ms" for p in probes)
    if not np.isfinite(np.concatenate([base, compute, measured])).all():  # lstsq cannot solve them
        notes.append(f"profile: step probes {probes_text} do not fit (their predictions overflow); not used")
        return model
    (k, f), *_ = np.linalg.lstsq(np.stack([compute, np.ones_like(compute)], axis=1), measured - base, rcond=None)
    if f < 0:  # no negative work: compute alone, through the origin
        k, f = float(compute @ (measured - base) / (compute @ compute)), 0.0
    if not k > 0:
        notes.append(f"profile: step probes {probes_text} do not fit (compute x {k:.3g}); not used")
        return model
    speed = prof.stage_layer_scale if len(prof.stage_layer_scale) == model.num_stages else (1.0,) * model.num_stages
    notes.append(f"profile: step probes {probes_text}: compute x {k:.2f}, fixed {f * 1e3:.0f} ms a step")
    return model.with_stages([dataclasses.replace(s, device_flops=s.device_flops / k, fixed_s=f * v)
                              for s, v in zip(model.stages, speed)])


def _load_profile(profile, cfg: ModelConfig, setting: str = "profile"):
    """A checked Profile from a Profile, a JSON path or None; errors name `setting`, what the user
    set (plan's `profile`, which the plan CLI's --profile passes, or ParallelConfig.profile)."""
    if profile is None:
        return None
    prof = Profile.load(profile, setting) if isinstance(profile, (str, os.PathLike)) else profile
    if not isinstance(prof, Profile):
        raise ConfigError(f"{setting} = {profile!r} is not allowed; allowed: a profile JSON path or a Profile")
    where = f"{setting} {str(profile)!r}" if isinstance(profile, (str, os.PathLike)) else setting
    for name in ("micro_batch", "seq_len"):
        check_positive(f"{where}: {name}", getattr(prof, name))

    def number(name, value, low_open=True):
        # finite too: JSON spells Infinity and NaN, and either turns every prediction into nan
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not (ok and (value > 0 if low_open else value >= 0)):
            raise ConfigError(f"{where}: {name} = {value!r} is not allowed; "
                              f"allowed: a finite number {'>' if low_open else '>='} 0")

    for name in ("layer_fwd_flops", "layer_fwd_s"):
        number(name, getattr(prof, name))
    for name in ("layer_bwd_s", "update_s_per_param"):
        number(name, getattr(prof, name), low_open=False)
    for i, scale in enumerate(prof.stage_layer_scale):
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not 0 < scale <= 1:
            raise ConfigError(f"{where}: stage_layer_scale[{i}] = {scale!r} is not allowed; allowed: a number in (0, 1]")
    for kind, links in (("data_links", prof.data_links), ("stage_links", prof.stage_links)):
        for i, l in enumerate(links):
            if l is not None:
                number(f"{kind}[{i}].bytes_per_s", l.bytes_per_s)
                number(f"{kind}[{i}].latency_s", l.latency_s, low_open=False)
    for kind in ("step_probes", "split_probes"):
        for i, probe in enumerate(getattr(prof, kind)):
            layers = probe.stage_layers
            # at most a plan's layers and microbatches: the fit predicts each probe (its layers, its ticks)
            if not (layers and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in layers)
                    and sum(layers) <= MAX_LAYERS):
                raise ConfigError(f"{where}: {kind}[{i}].stage_layers = {list(layers)!r} is not allowed; "
                                  f"allowed: positive layer counts per stage, at most {MAX_LAYERS} in all")
            for name in ("dp", "tp", "microbatches"):
                check_positive(f"{where}: {kind}[{i}].{name}", getattr(probe, name))
            if probe.microbatches > MAX_GIVEN_MICROBATCHES:
                raise ConfigError(f"{where}: {kind}[{i}].microbatches = {probe.microbatches} is not allowed; "
                                  f"allowed: at most {MAX_GIVEN_MICROBATCHES}")
            if probe.schedule not in SCHEDULES:
                raise ConfigError(f"{where}: {kind}[{i}].schedule = {probe.schedule!r} is not allowed; "
                                  f"choose one of {', '.join(map(repr, SCHEDULES))}")
            number(f"{kind}[{i}].step_s", probe.step_s)
    for name, allowed in (("compute_dtype", ("float32", "bfloat16")), ("remat", REMAT)):
        if getattr(prof, name) not in (None, *allowed):
            raise ConfigError(f"{where}: {name} = {getattr(prof, name)!r} is not allowed; "
                              f"allowed: one of {', '.join(map(repr, allowed))} or null")
    # Layer times at another dtype do not scale by FLOPs (a device's rate differs by dtype).
    if prof.compute_dtype not in (None, cfg.compute_dtype):
        raise ConfigError(f"{where}: compute_dtype = {prof.compute_dtype!r} (its layer times) is not allowed with "
                          f"ModelConfig.compute_dtype = {cfg.compute_dtype!r} (the plan CLI's --dtype); allowed: a "
                          f"profile measured with {cfg.compute_dtype!r}")
    # A profile of another model: its recorded block differs from this model's (older profiles
    # record none), or XLA's count of its block is far from this model's analytic one.
    if prof.block is not None and prof.block != block_shape(cfg):
        def shape(block):
            return ", ".join(f"{k} {v}" for k, v in block.items()) if isinstance(block, dict) else repr(block)
        raise ConfigError(f"{where}: it measured blocks of {shape(prof.block)}, but model {cfg.preset!r} has "
                          f"{shape(block_shape(cfg))}; allowed: a profile of this model")
    analytic = workload.model_costs(cfg, prof.micro_batch, prof.seq_len).layers[0].fwd_flops
    if not 0.5 <= prof.layer_fwd_flops / analytic <= 2.0:
        raise ConfigError(f"{where}: its layer has {prof.layer_fwd_flops:.4g} forward FLOPs at micro batch "
                          f"{prof.micro_batch}, seq {prof.seq_len}, but model {cfg.preset!r} (hidden {cfg.hidden}, "
                          f"ffn {cfg.ffn_hidden}) has {analytic:.4g}; allowed: a profile of this model")
    return prof


def _with_profile(prof, cfg: ModelConfig, costs: workload.ModelCosts, micro_batch: int, seq_len: int,
                  pl: Placement, topo: Topology, dp_links: list, boundaries: list, notes: list[str]):
    """(layers, device FLOP/s per stage, optimizer seconds per parameter per stage, data links,
    boundary links) with the profile's measurements; `notes` collects how it was used (Plan.notes).

    The cost model divides FLOPs by a device rate, so measured seconds enter as a rate: the
    analytic forward FLOPs of a layer at the profile's shape over its measured forward seconds.
    Each layer's backward FLOPs become its forward FLOPs times the measured backward/forward ratio,
    so forward and backward each take their measured time (scaled by FLOPs to the plan's shape).
    """
    pp, dp, tp = pl.grid.shape
    ref = workload.model_costs(cfg, prof.micro_batch, prof.seq_len).layers[0].fwd_flops
    rate = ref / prof.layer_fwd_s  # analytic FLOP/s the profiled device reached
    ratio = prof.layer_bwd_s / prof.layer_fwd_s
    if prof.remat not in (None, cfg.remat):  # the measured backward recomputes what the profile's remat did
        measured = dataclasses.replace(cfg, remat=prof.remat)
        remat_scale = (workload.model_costs(cfg, prof.micro_batch, prof.seq_len).layers[0].bwd_flops
                       / workload.model_costs(measured, prof.micro_batch, prof.seq_len).layers[0].bwd_flops)
        ratio *= remat_scale
        notes.append(f"profile: backward measured with remat {prof.remat!r}, scaled by analytic FLOPs "
                     f"x{remat_scale:.3g} to this model's {cfg.remat!r}")
    layers = tuple(workload.Part(l.params, l.fwd_flops, l.fwd_flops * ratio) for l in costs.layers)
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
    if len(prof.stage_layer_scale) == pp:
        # measured per stage (devices that differ in speed): these replace the topology's ratios
        device_flops = [rate / scale for scale in prof.stage_layer_scale]
        update = [prof.update_s_per_param * scale for scale in prof.stage_layer_scale]
        notes.append("profile: stage speeds measured, layer times x " +
                     ", ".join(f"{scale:.2f}" for scale in prof.stage_layer_scale))
    else:
        if prof.stage_layer_scale:
            notes.append(f"profile: its {len(prof.stage_layer_scale)} stage speeds ignored (this plan has pp = {pp}); "
                         f"topology device ratios used")
        if any(f != own for f in pl.device_flops):
            notes.append("profile: stages on other device types scaled by their device_tflops * device_efficiency")
    # the profiled mesh's data and tensor sizes, as its step probes (as many stages as its links) record them
    profiled = next(((p.dp, p.tp) for p in prof.step_probes if len(p.stage_layers) == len(prof.data_links)), None)
    if any(prof.data_links) and profiled not in (None, (dp, tp)):
        notes.append(f"profile: its data-group links measured at dp {profiled[0]}, tp {profiled[1]} ignored (this "
                     f"plan has dp {dp}, tp {tp}); topology figures used")
    elif len(prof.data_links) == pp:
        used = []
        for s, l in enumerate(prof.data_links):
            if l is not None and dp > 1:
                # The profile fits one fixed cost per all-reduce; the cost model counts 2(n - 1) hops.
                dp_links[s] = Link(l.bytes_per_s, l.latency_s / (2 * (dp - 1)), f"{dp_links[s].via}, measured")
                used.append(s)
        if used:
            notes.append(f"profile: measured data-group links for stage(s) {', '.join(map(str, used))}")
    elif prof.data_links:
        notes.append(f"profile: its {len(prof.data_links)} data-group links ignored (this plan has pp = {pp}); "
                     f"topology figures used")
    if pp > 1 and len(prof.stage_links) == pp - 1:
        # null: not measured there, the topology's figure stays
        boundaries = [b if l is None else Link(l.bytes_per_s, l.latency_s, f"{b.via}, measured")
                      for l, b in zip(prof.stage_links, boundaries)]
        if any(prof.stage_links):
            notes.append("profile: measured stage-boundary links")
    elif prof.stage_links:
        notes.append(f"profile: its {len(prof.stage_links)} stage-boundary links ignored (this plan has pp = {pp}); "
                     f"topology figures used")
    return layers, device_flops, update, dp_links, boundaries


def _stash_bytes(cfg: ModelConfig, costs: workload.ModelCosts, tp: int, micro_batch: int, seq_len: int) -> float:
    """Activations one layer keeps per in-flight microbatch on one device, by remat policy: 'full'
    its input; 'dots' its input, the attention projection's output and the column-parallel
    matmuls' outputs (q, k, v, the MLP's first one(s)), split over tp; 'none' every residual
    JAX's autodiff saves (workload.layer_residual_bytes). Korthikanti et al.'s
    s*b*h*(10 + 24/t + 5*a*s/(h*t)) 16-bit bytes, used before, were 0.5-0.6 of what the runtime
    keeps: JAX keeps the norms' activations in float32 and six ffn-wide arrays."""
    h, f, kv = cfg.hidden, cfg.ffn_hidden, cfg.num_kv_heads * cfg.head_dim
    if cfg.remat == "full":
        return costs.activation_bytes
    if cfg.remat == "dots":
        return costs.activation_bytes * (2 + (h + 2 * kv + (2 if cfg.mlp == "swiglu" else 1) * f) / (h * tp))
    return workload.layer_residual_bytes(cfg, micro_batch, seq_len, tp)


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
    tps = ([t for t in placement.divisors(node) if cfg.num_kv_heads % t == 0 and cfg.ffn_hidden % t == 0]
           if "tp" in free else [par.tp])
    dp = None if "dp" in free else par.dp
    for tp in tps:
        if "pp" not in free:
            yield tp, par.pp, dp
        elif dp is not None:
            yield tp, max(n // (tp * dp), 1), dp
        else:
            # tp over the devices leaves no pp: pp 1 then, for the placement to say why
            yield from ((tp, pp, None) for pp in placement.divisors(max(n // tp, 1)) if pp <= cfg.num_layers)


def _check_model(cfg: ModelConfig, topo: Topology, tp: int, pp: int, mixed_ok: bool) -> None:
    """`mixed_ok`: stages may span clusters (else a pp offered must keep them whole)."""
    if cfg.num_heads % tp or cfg.num_kv_heads % tp or cfg.ffn_hidden % tp:
        raise ConfigError(f"tp = {tp} is not allowed: it must divide ModelConfig.num_heads = {cfg.num_heads}, "
                          f"ModelConfig.num_kv_heads = {cfg.num_kv_heads} and ModelConfig.ffn_hidden = {cfg.ffn_hidden}")
    # the pp offered must also pass the placement's checks with this tp
    offered = placement.dividing_pp if mixed_ok else placement.fitting_pp
    partition.check_stages(cfg.num_layers, pp, offered(topo, tp, cfg.num_layers))


def _microbatch_options(par: ParallelConfig, free: set, global_batch: int, dp: int, pp: int) -> list[int]:
    """The microbatch counts to try for `dp` replicas (which the caller has checked divide the batch)."""
    per_replica = global_batch // dp
    if "microbatches" in free:
        cap = min(MAX_MICROBATCHES_PER_STAGE * pp, MAX_MICROBATCHES)
        # only up to the cap: listing every divisor of a huge batch would take forever
        allowed = [m for m in range(1, min(cap, per_replica) + 1) if per_replica % m == 0]
        return [m for m in allowed if m >= pp] or allowed[-1:]
    return [par.microbatches]  # that it splits per_replica is checked by the caller (_unsplit_microbatches)


def _more_microbatches(per_replica: int, tried: list[int]) -> list[int]:
    """Microbatch counts past the search's cap, up to MAX_MICROBATCHES, for a layout that does not fit
    memory under it."""
    return [m for m in range(max(tried) + 1, min(per_replica, MAX_MICROBATCHES) + 1) if per_replica % m == 0]


def _topology(topology) -> Topology:
    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, (str, os.PathLike)):
        return load(topology)
    if isinstance(topology, Mapping):  # the TOML file's tables, e.g. built in a script
        return from_dict(dict(topology))
    raise ConfigError(f"topology = {topology!r} is not allowed; allowed: a TOML file path, a dict shaped like "
                      f"one, or a Topology")


def plan(topology, model, parallel: ParallelConfig | None = None, *, global_batch: int = DEFAULT_GLOBAL_BATCH,
         seq_len: int | None = None, auto: Iterable[str] | None = None, allow_mixed: bool = False,
         ratios: Mapping[str, float] | None = None, profile=None) -> Plan:
    """Plans `model` (a preset name or ModelConfig) on `topology` (a TOML path, a dict of its
    tables, or a Topology).

    `parallel` fixes tp, pp, dp (None: what is left), microbatches, the partition method or
    stage_layers, the schedule, placement, zero1 and the wire dtypes over `data`. `auto` names
    the sizes of SEARCHABLE that the cost model chooses instead; default: all of them without
    `parallel`, none with it.
    `allow_mixed`: let a holmes stage span clusters (reported) instead of refusing.
    `ratios`: holmes-ratio's weight per cluster name (default: cluster NIC Gb/s).
    `profile`: a measured Profile (or its JSON path); None: `parallel.profile`, else analytic costs
    and topology links (see the module doc).
    """
    topo = _topology(topology)
    cfg = presets.resolve(model if isinstance(model, ModelConfig) else ModelConfig(preset=model))
    if cfg.num_layers > MAX_LAYERS:
        raise ConfigError(f"ModelConfig.num_layers = {cfg.num_layers} is not allowed in a plan; "
                          f"allowed: at most {MAX_LAYERS}")
    par = ParallelConfig() if parallel is None else parallel
    if not isinstance(par, ParallelConfig):
        raise ConfigError(f"parallel = {parallel!r} is not allowed; allowed: a ParallelConfig or None")
    par.validate()
    if not isinstance(allow_mixed, bool):  # allow_mixed="no" would allow them
        raise ConfigError(f"allow_mixed = {allow_mixed!r} is not allowed; allowed: True or False")
    auto = (auto,) if isinstance(auto, str) else auto  # auto="pp": one name, not its letters
    if auto is not None:
        names = tuple(auto) if isinstance(auto, Iterable) else None
        if names is None or not all(isinstance(name, str) for name in names):
            raise ConfigError(f"auto = {auto!r} is not allowed; allowed: names among {', '.join(SEARCHABLE)}")
        auto = names
    free = set(SEARCHABLE if parallel is None else ()) if auto is None else set(auto)
    if free - set(SEARCHABLE):
        raise ConfigError(f"auto = {sorted(free)} is not allowed; allowed: any of {', '.join(SEARCHABLE)}")
    if par.stage_layers is not None:
        free.discard("pp")
    if "microbatches" not in free and par.microbatches > MAX_GIVEN_MICROBATCHES:
        raise ConfigError(f"microbatches = {par.microbatches} is not allowed in a plan; "
                          f"allowed: at most {MAX_GIVEN_MICROBATCHES}")
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    for name, value in (("global_batch", global_batch), ("seq_len", seq_len)):
        check_positive(name, value)
    if seq_len > cfg.max_seq_len:
        raise ConfigError(f"seq_len = {seq_len} is not allowed; "
                          f"allowed: up to ModelConfig.max_seq_len = {cfg.max_seq_len}")
    if ratios is not None and not (isinstance(ratios, Mapping)
                                   and all(is_number(v) and v > 0 for v in ratios.values())):
        raise ConfigError(f"ratios = {ratios!r} is not allowed; allowed: a finite positive weight per cluster "
                          f"name ({', '.join(c.name for c in topo.clusters)})")
    prof = (_load_profile(profile, cfg) if profile is not None
            else _load_profile(par.profile, cfg, "ParallelConfig.profile"))

    candidates, errors, mixed = _candidates(topo, cfg, par, free, global_batch, seq_len, allow_mixed, ratios, prof)
    if not candidates:
        errors = list(dict.fromkeys(errors))
        message = errors[0] if len(errors) == 1 else f"no layout fits ({len(errors)} kinds of misfit); first: {errors[0]}"
        # what allow_mixed would add: the layouts refused for a stage spanning clusters, screened with it
        hint = _mixed_hint(_candidates(topo, cfg, par, free, global_batch, seq_len, True, ratios, prof, mixed)[0])
        raise ConfigError(message + (f"; {hint}" if hint else ""))
    # Simulate in lower-bound order, stopping once no bound can beat the FULL_SEARCH-th best time.
    timed = []
    for c in sorted(candidates, key=lambda c: c.bound):
        if len(timed) >= FULL_SEARCH and c.bound >= timed[FULL_SEARCH - 1][0]:
            break
        timed = sorted(timed + [(c.screen_time(), len(timed), c)], key=lambda t: t[:2])
    best = None
    for _, _, c in timed[:FULL_SEARCH]:
        prediction = c.model.predict(partition.split(par.partition, c.model, c.weights, par.stage_layers))
        if best is None or prediction.step_time_s < best[0].step_time_s:
            best = prediction, c
    prediction, c = best
    partitions = {m: c.model.predict(partition.split(m, c.model, c.weights)) for m in partition.METHODS}
    notes = c.notes
    if prof is not None and par.partition == "auto" and par.stage_layers is None:
        timed, note = _timed_split(prof, cfg, c, workload.micro_batch(global_batch, c.placement.grid.shape[1],
                                                                      c.model.microbatches), seq_len)
        notes += (note,) if note else ()
        if timed is not None:
            prediction = partitions["auto"] = c.model.predict(timed)
    # the links the prediction used, a profile's measured ones included (the table and the drawing
    # showed the topology's figures beside times from the measured ones)
    used = dataclasses.replace(c.placement, data_routes=tuple(stage.dp_link for stage in c.model.stages),
                               boundary_routes=c.model.boundaries)
    return Plan(topo, cfg, used, prediction.stage_layers,
                "explicit" if par.stage_layers is not None else par.partition, c.model.schedule, c.model.microbatches,
                global_batch, seq_len, c.model.zero1, par.grad_reduce_dtype, par.update_gather_dtype, prediction,
                partitions, notes)


def _mixed_hint(mixed: list["_Candidate"]) -> str | None:
    """Where nothing fits without allow_mixed, a line on the fastest of the candidates only it
    allows (at their screening splits), or None where there is none. Only a plan's, not a note:
    training has no such setting."""
    best, best_time = None, math.inf
    for c in sorted(mixed, key=lambda c: c.bound):  # simulated in lower-bound order, as the search does
        if c.bound >= best_time:
            break
        step = c.screen_time()
        if step < best_time:
            best, best_time = c, step
    if best is None:
        return None
    pp, dp, tp = best.placement.grid.shape
    layout = f"tp = {tp}, pp = {pp}, dp = {dp}, microbatches = {best.model.microbatches}, {best.model.schedule}"
    return (f"with stages spanning clusters {layout} fits ({best_time:.3g} s a step; the planner's "
            f"allow_mixed=True, --allow-mixed)")


def _timed_split(prof: Profile, cfg: ModelConfig, c: "_Candidate", micro_batch: int,
                 seq_len: int) -> tuple[tuple[int, ...] | None, str | None]:
    """`auto`'s split where the profile timed this model's own step at several splits of this
    layout (`split_probes`) and of this micro batch, sequence and remat: the fastest measured, and
    a note. (None, note) where the probes are of another layout or model; (None, None) where there
    are none."""
    if not prof.split_probes:
        return None, None
    # the head's share of a stage's work, and so the best split, changes with these
    same_work = (prof.micro_batch, prof.seq_len) == (micro_batch, seq_len) and prof.remat in (None, cfg.remat)
    mine = [p for p in prof.split_probes
            if (len(p.stage_layers), p.dp, p.tp) == tuple(c.placement.grid.shape) and sum(p.stage_layers) == cfg.num_layers
            and (p.microbatches, p.schedule) == (c.model.microbatches, c.model.schedule)] if same_work else []
    if len(mine) == 1:  # auto takes the fastest of two or more
        return None, f"profile: it timed one split of this layout, {list(mine[0].stage_layers)}: nothing to compare; not used"
    if not mine:
        return None, (f"profile: its timed splits are not of this layout (mesh {tuple(c.placement.grid.shape)}, "
                      f"{cfg.num_layers} layers, {c.model.microbatches} microbatches, {c.model.schedule}, micro batch "
                      f"{micro_batch} x seq {seq_len}, remat {cfg.remat!r}); not used")
    fastest = min(mine, key=lambda p: p.step_s)
    timed = ", ".join(f"{list(p.stage_layers)} {p.step_s * 1e3:.0f} ms" for p in sorted(mine, key=lambda p: p.step_s))
    return tuple(fastest.stage_layers), f"profile: splits timed {timed}: auto takes the fastest"


@dataclasses.dataclass(frozen=True, eq=False)
class _Candidate:
    bound: float  # no schedule of this candidate beats it (CostModel.lower_bounds)
    placement: Placement
    model: CostModel
    weights: list[float]  # holmes-ratio's per stage
    # the screening splits: for auto every split where there are few, else the time-balanced one (or the
    # even one where that is over memory); else the method's own
    splits: np.ndarray  # (count, stages)
    notes: tuple[str, ...]  # how a measured profile entered its cost model

    def screen_time(self) -> float:
        """The predicted step of the fastest screening split (walks the tick table)."""
        return float(self.model.step_times(self.splits).min())


def _candidates(topo: Topology, cfg: ModelConfig, par: ParallelConfig, free: set, global_batch: int, seq_len: int,
                allow_mixed: bool, ratios, prof=None,
                layouts: Iterable[tuple] | None = None) -> tuple[list[_Candidate], list[str], list[tuple]]:
    """Every (layout, microbatches, schedule) that fits the topology, the model, the batch and
    device memory; why the others do not; and the (tp, pp, dp) the holmes placement refused only
    because a stage would span clusters (what allow_mixed would add). `layouts`: only these
    (default: every one `_layouts` yields)."""
    found, errors, misfits = [], [], []  # misfits: layouts the model or the topology refuse
    mixed = []  # layouts refused only for a stage spanning clusters
    undivided = set()  # dp that do not divide the global batch
    unsplit = {}  # dp -> a replica's samples, where the given microbatches do not split them
    over = []  # (need / have, why) of the layouts over device memory
    beyond = []  # layouts that fit memory only with more microbatches than the search tries
    infinite = []  # layouts that fit memory but whose predicted step overflows
    remat_hint = "" if cfg.remat == "full" else ", or ModelConfig.remat = 'full', the plan CLI's --remat"
    own_split = par.stage_layers is not None or par.partition != "auto"  # else the search picks one that fits
    schedules = SCHEDULES if "schedule" in free else [par.schedule]
    same_layers = len({layer.params for layer in workload.model_costs(cfg, 1, seq_len).layers}) == 1
    for tp, pp, dp in _layouts(topo, cfg, par, free) if layouts is None else layouts:
        try:
            if dp is not None and "pp" in free:  # before the model's check of the pp derived from it
                placement.check_dp(topo.num_devices, tp, dp)  # (a pp given: place names the one dp it allows)
            _check_model(cfg, topo, tp, pp, allow_mixed or par.placement != "holmes")
        except ConfigError as e:
            misfits.append(str(e))
            continue
        try:
            pl = placement.place(topo, tp, pp, dp, par.placement, allow_mixed, max_pp=cfg.num_layers,
                                 pp_given="pp" not in free)
        except ConfigError as e:
            misfits.append(str(e))
            if _refused_as_mixed(topo, tp, pp, dp, par, allow_mixed, cfg.num_layers):
                mixed.append((tp, pp, dp))
            continue
        replicas = pl.grid.shape[1]
        if global_batch % replicas:
            undivided.add(replicas)  # one error for all of them, below
            continue
        if "microbatches" not in free and (global_batch // replicas) % par.microbatches:
            unsplit[replicas] = global_batch // replicas  # one error for all of them, below
            continue
        options = _microbatch_options(par, free, global_batch, replicas, pp)
        weights = _stage_ratios(topo, pl, ratios)
        even = partition.uniform(cfg.num_layers, pp)
        # Past the microbatch cap only where nothing under it fits memory, or only a slower split
        # than the time-balanced one: smaller micro batches then are what makes the layout (or its
        # faster split) fit. More memory gave a slower plan: the even split at 64 microbatches,
        # where 128 fitted the balanced split.
        more = _more_microbatches(global_batch // replicas, options) if "microbatches" in free else []
        fitted, overflowed, squeezed = len(found), len(infinite), False
        for group in (options, more):
            if (len(found) > fitted or len(infinite) > overflowed) and not squeezed:  # some fit memory
                break
            for m, schedule in itertools.product(group, schedules):
                model, notes = _cost_model(cfg, pl, global_batch, seq_len, m, schedule, par, prof, topo)
                if own_split:
                    split = partition.split(par.partition, model, weights, par.stage_layers)
                elif same_layers and not model.stage_terms([even])["fits"][0]:
                    # with identical layers a stage's memory grows with the longest stage only, which
                    # the even split keeps shortest: no split fits, so skip the balancing
                    split = even
                else:
                    split = partition.time_balanced(model)
                    squeezed = not model.stage_terms([split])["fits"][0]
                    if squeezed:  # more layers on a fast stage can be over memory where the even split is not
                        split = even
                bound = float(model.lower_bounds([split])[0])
                if not np.isfinite(bound):
                    terms = model.stage_terms([split])
                    # in memory, but its times overflow a float (device_tflops = 1e-308; a backward
                    # time of 1e306 made each layer's FLOPs inf, their sums' differences nan)
                    if terms["fits"][0]:
                        infinite.append(f"tp = {tp}, pp = {pp}, microbatches = {m}, schedule {schedule}: the "
                                      f"predicted step is not finite; allowed: device, link and profile figures "
                                      f"whose times a float holds")
                        continue
                    memory = terms["memory"][0]
                    s = int(np.argmax(memory / np.array(pl.device_memory)))
                    # memory is the longest stage's: an uneven split of the user's may be what is over
                    uneven = own_split and max(split) > -(-cfg.num_layers // pp)
                    over.append((memory[s] / pl.device_memory[s],
                                 f"tp = {tp}, pp = {pp}, microbatches = {m}, schedule {schedule}"
                                 f"{', stage layers ' + ','.join(map(str, split)) if own_split else ''} do not fit "
                                 f"in device memory: stage {s} needs {memory[s] / 1e9:.3g} GB, its devices have "
                                 f"{pl.device_memory[s] / 1e9:.3g} GB; allowed: layouts that fit (or a larger "
                                 f"device_memory_gb in the topology{remat_hint}"
                                 f"{', or a more even split: partition auto picks one that fits' if uneven else ''})"))
                    continue
                splits = np.array([split])
                if not own_split and math.comb(cfg.num_layers - 1, pp - 1) <= partition.EXHAUSTIVE_LIMIT:
                    # Every split where auto's full search would try them all (one batched walk of
                    # the ticks): the time-balanced split ignores each stage's gradient sync, and
                    # where a slow data ring makes that weigh, a layout screened at it alone looks
                    # too slow to get the full search.
                    splits = partition.compositions(cfg.num_layers, pp)
                    bound = float(model.lower_bounds(splits).min())
                found.append(_Candidate(bound, pl, model, weights, splits, notes))
        if "microbatches" in free and len(found) == fitted and len(infinite) == overflowed:
            beyond += _past_the_cap(cfg, pl, global_batch, seq_len, schedules, par, prof, topo)
    if undivided:
        errors.append(_undivided_batch(global_batch, undivided, 1 if "microbatches" in free else par.microbatches))
    if unsplit:
        errors.append(_unsplit_microbatches(par.microbatches, global_batch, unsplit))
    # What stopped the layouts that divide the batch first (an infinite step: in memory, so its
    # figures are what is wrong; then a fit only past the microbatch cap; then over memory, the
    # nearest to fitting first: the one worth reading), then batch misfits: another layout's dp
    # not dividing the batch is no news when those that do fail on memory. A searched pp that does
    # not fit the clusters comes last (--microbatches 7 is not an --allow-mixed problem).
    tried = infinite + beyond + [text for _, text in sorted(over, key=lambda o: o[0])]
    return found, tried + errors + misfits, mixed


def _refused_as_mixed(topo: Topology, tp: int, pp: int, dp: int | None, par: ParallelConfig, allow_mixed: bool,
                      max_pp: int) -> bool:
    """Whether the holmes placement refused (tp, pp, dp) only because a stage would span clusters."""
    if allow_mixed or par.placement != "holmes" or len(topo.clusters) < 2:
        return False
    try:
        placement.place(topo, tp, pp, dp, par.placement, True, max_pp=max_pp)
    except ConfigError:
        return False
    return True


def _undivided_batch(global_batch: int, undivided: set[int], microbatches: int = 1) -> str:
    """The error for a global batch that no tried layout's dp divides, naming every such dp (the
    first layout's is often the largest, a needlessly large batch to suggest). `microbatches`: a
    given count, which each replica's samples must split into too: the batches offered do."""
    split = f", split into {microbatches} microbatches" if microbatches > 1 else ""
    if len(undivided) == 1:
        (dp,) = undivided
        return (f"global_batch = {global_batch} is not allowed with dp = {dp}: every data replica needs the same "
                f"samples{split}; allowed: a multiple of {dp * microbatches}")
    units = [dp * microbatches for dp in sorted(undivided)]
    return (f"global_batch = {global_batch} is not allowed: every data replica needs the same samples{split}, and "
            f"dp = {', '.join(map(str, sorted(undivided)))} do not divide it; allowed: a multiple of "
            f"{', '.join(map(str, units))} (the smallest: {units[0]})")


def _unsplit_microbatches(microbatches: int, global_batch: int, unsplit: Mapping[int, int]) -> str:
    """The error for given microbatches that split no tried layout's replica samples evenly, naming
    each tried dp and its replica's samples (not just the first layout's)."""
    if len(unsplit) == 1:
        (replica,) = unsplit.values()
        return (f"microbatches = {microbatches} is not allowed: each data replica's {replica} samples must split "
                f"evenly; allowed: a divisor of {replica}")
    each = ", ".join(f"{replica} (dp = {dp})" for dp, replica in sorted(unsplit.items()))
    return (f"microbatches = {microbatches} is not allowed: each data replica's samples (global_batch {global_batch} "
            f"/ dp) must split evenly, and with dp = {', '.join(map(str, sorted(unsplit)))} they do not; "
            f"allowed: a divisor of {each}")


def _past_the_cap(cfg: ModelConfig, pl: Placement, global_batch: int, seq_len: int, schedules: list,
                  par: ParallelConfig, prof, topo: Topology) -> list[str]:
    """Why a layout over memory at every microbatch count the search tries (up to MAX_MICROBATCHES)
    is still worth giving: it fits with more, which a user may give (up to MAX_GIVEN_MICROBATCHES).
    Memory alone is checked (no schedule is walked), the even split, fewest microbatches first."""
    pp, dp, tp = pl.grid.shape
    per_replica = global_batch // dp
    for m in range(MAX_MICROBATCHES + 1, min(per_replica, MAX_GIVEN_MICROBATCHES) + 1):
        if per_replica % m:
            continue
        for schedule in schedules:
            model, _ = _cost_model(cfg, pl, global_batch, seq_len, m, schedule, par, prof, topo)
            if model.stage_terms([partition.uniform(cfg.num_layers, pp)])["fits"][0]:
                return [f"tp = {tp}, pp = {pp} fits device memory only with more microbatches than the search tries "
                        f"(up to {MAX_MICROBATCHES}): with microbatches = {m}, schedule {schedule}; allowed: give "
                        f"them (ParallelConfig.microbatches, the plan CLI's --microbatches; up to "
                        f"{MAX_GIVEN_MICROBATCHES})"]
    return []
