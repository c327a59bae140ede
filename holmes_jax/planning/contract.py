"""The Plan: all a run needs from planning. The (pp, dp, tp) device grid and mesh sizes, layers
per stage, schedule and microbatches, the predicted step; printable (`explain`) and serialisable
(`to_dict`, `to_json`: the contract of `python -m holmes_jax.plan --json`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Mapping

import numpy as np

from holmes_jax.config import ModelConfig
from holmes_jax.planning import workload
from holmes_jax.planning.communicators import Communicator, communicators
from holmes_jax.planning.cost import Prediction
from holmes_jax.planning.placement import AXES, Placement
from holmes_jax.planning.topology import Link, Topology

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
    zero1: bool  # in effect: ParallelConfig.zero1 with more than one data replica
    grad_reduce_dtype: str  # what gradients cross `data` in
    update_gather_dtype: str  # what ZeRO-1's gather of the parameter updates moves
    prediction: Prediction
    partitions: Mapping[str, Prediction]  # every partition method's split on this layout
    notes: tuple[str, ...] = ()  # how a measured profile was used (or why parts of it were not)

    def __repr__(self) -> str:
        # Not the fields' own: the topology, placement and every partition's prediction ran to
        # thousands of characters. explain() prints it all.
        return (f"Plan(topology={self.topology.name!r}, model={self.model.preset!r}, mesh={self.mesh}, "
                f"stage_layers={self.stage_layers}, partition={self.partition!r}, schedule={self.schedule!r}, "
                f"microbatches={self.microbatches}, step_time_s={self.prediction.step_time_s:.4g}, "
                f"fits={self.prediction.fits})")

    @property
    def grid(self) -> np.ndarray:
        """(pp, dp, tp) topology device numbers."""
        return self.placement.grid

    @property
    def mesh(self) -> dict[str, int]:
        return dict(zip(AXES, self.grid.shape))

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
        return workload.micro_batch(self.global_batch, self.dp, self.microbatches)

    @property
    def communicators(self) -> tuple[Communicator, ...]:
        """Each stage's data and tensor communicators and each stage boundary, with its fabric."""
        return communicators(self.topology, self.grid)

    @property
    def flops_formula(self) -> str:
        return FLOPS_FORMULA[self.model.remat == "full"]

    def to_dict(self) -> dict:
        pl = self.placement
        return {
            "model": self.model.preset, "model_config": dataclasses.asdict(self.model),
            "topology": self.topology.to_dict(), "devices": int(self.grid.size),
            "mesh": self.mesh, "placement": pl.method, "schedule": self.schedule,
            "microbatches": self.microbatches, "micro_batch": self.micro_batch,
            "global_batch": self.global_batch, "seq_len": self.seq_len, "zero1": self.zero1,
            "grad_reduce_dtype": self.grad_reduce_dtype, "update_gather_dtype": self.update_gather_dtype,
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
            "communicators": [c.to_dict() for c in self.communicators],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def explain(self) -> str:
        """A readable table: stages, their cluster and NIC, layers, times, links, the predicted step."""
        pl, pr, m = self.placement, self.prediction, self.model
        fixed = any(pr.stage_fixed_s)  # a profile's fitted per-step work: shown where there is some
        lines = [
            f"plan: {m.preset} ({m.num_layers} layers, hidden {m.hidden}, {m.compute_dtype}"
            f"{'' if m.remat == 'none' else f', remat {m.remat}'}) on topology {self.topology.name!r}: "
            f"{self.grid.size} device{'' if self.grid.size == 1 else 's'}, {len(self.topology.clusters)} cluster(s)",
            f"mesh stage={self.pp} data={self.dp} tensor={self.tp} | placement {pl.method} | schedule {self.schedule}, "
            f"{self.microbatches} microbatch{'es' * (self.microbatches > 1)} of {self.micro_batch} "
            f"(global batch {self.global_batch}, seq {self.seq_len})"
            f" | partition {self.partition}",
            "",
            _table(["stage", "cluster", "nic", "layers", "fwd+bwd/mb", "compute", "sync", "update"]
                   + (["fixed"] if fixed else []) + ["finish", "memory", "gradient ring"],
                   [[s, pl.stage_clusters[s], pl.stage_nic[s], self.stage_layers[s],
                     format_seconds(pr.stage_fwd_s[s] + pr.stage_bwd_s[s]), format_seconds(pr.stage_compute_s[s]),
                     format_seconds(pr.stage_sync_s[s]), format_seconds(pr.stage_update_s[s])]
                    + ([format_seconds(pr.stage_fixed_s[s])] if fixed else [])
                    + [format_seconds(pr.stage_finish_s[s]),
                       f"{_bytes(pr.stage_memory_bytes[s])} of {_bytes(pl.device_memory[s])}",
                       _route_text(pl.data_routes[s]) if self.dp > 1 else "-"] for s in range(self.pp)]),
        ]
        if self.pp > 1:
            lines += ["", _table(["boundary", "activations cross", "per microbatch, each way"],
                                 [[f"{s} -> {s + 1}", _route_text(r), format_seconds(pr.p2p_s[s])]
                                  for s, r in enumerate(pl.boundary_routes)])]
        lines += ["", _table(["communicators", "stages", "groups x size", "nic classes", "transport"],
                             [[c.kind, "->".join(map(str, c.stages)), f"{c.groups} x {c.size}", "+".join(c.nic_classes),
                               c.transport + (" (own cliques, across clusters)" if c.kind == "stage_boundary"
                                              and c.spans_clusters else "")]
                              for c in self.communicators])] if self.communicators else []
        if pl.mixed_stages:
            lines += ["", "stages spanning clusters: " + "; ".join(
                f"{s} ({pl.stage_clusters[s]}, data groups {'+'.join(pl.data_groups_nic[s])})"
                for s in pl.mixed_stages)]
        lines += [
            "",
            f"predicted step {format_seconds(pr.step_time_s)} | {pr.samples_per_s:.4g} samples/s | "
            f"{pr.tflops_per_device:.4g} TFLOPS/device ({self.flops_formula})",
            "partitions on this layout: " + " | ".join(
                f"{name} {','.join(map(str, p.stage_layers))} {format_seconds(p.step_time_s)}"
                f"{'' if p.fits else ' (over memory)'}"
                for name, p in self.partitions.items()),
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _route_dict(r: Link) -> dict:
    return {"via": r.via, "gbps_per_transfer": r.bytes_per_s * 8 / 1e9, "latency_us": round(r.latency_s * 1e6, 6),
            "shared_by": r.shared_by}


def _route_text(r: Link) -> str:
    shared = f", {r.shared_by} share a NIC" if r.shared_by > 1 else ""
    return f"{r.via}: {r.bytes_per_s * 8 / 1e9:.3g} Gb/s each{shared}"


def format_seconds(s: float) -> str:
    """`s` seconds in s, ms or us, as the plan's printout and pictures show them."""
    s = float(f"{s:.3g}")  # the unit of the rounded figure: 0.9996 s is 1 s, not "1e+03 ms"
    if 1000 <= s < 1e6:  # whole seconds; past a million, 3 digits and an exponent, not a row of digits
        return f"{s:.0f} s"
    return f"{s:.3g} s" if s >= 1 or s == 0 else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _bytes(n: float) -> str:
    n = float(f"{n:.3g}")
    return f"{n / 1e12:.3g} TB" if n >= 1e12 else f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def _table(header: list, rows: list[list]) -> str:
    cells = [[str(c) for c in row] for row in [header] + rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)
