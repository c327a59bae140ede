"""The Holmes paper's measurements, predicted by holmes_jax's cost model on the paper's own layouts.

What the paper measured (A100 nodes of 8 GPUs, sequence 2048, activation recompute):

- GPT-3.6B (30 layers, hidden 3072) on 4 nodes, one fabric at a time: pure InfiniBand, pure RoCE,
  pure Ethernet: 197, 160 and 122 TFLOPS per GPU.
- GPT-7.5B (36 layers, hidden 4096) on 4 InfiniBand + 4 RoCE nodes, the framework comparison read
  off its figure: Holmes about 195, Megatron-LLaMA about 175, Megatron-LM about 145,
  Megatron-DeepSpeed about 125 TFLOPS per GPU. The NIC-blind layout here stands for Megatron-LM:
  the same sizes, placed in Megatron's rank order over hosts listed with the clusters interleaved,
  so every data group spans both NIC classes and reduces over TCP sockets.

The layouts are the paper's, taken from the launch scripts of its reference code (GitHub
CodexDive/Holmes), not searched:

- GPT-3.6B, `examples/pretrain_gpt_2_nodes.sh`: tensor parallel 1, pipeline parallel 1, micro
  batch 4, global batch 512. So on 4 nodes: data parallel 32, 4 microbatches a replica. (That script
  also passes a 16/14 layer split for a two-node IB + RoCE run; with pipeline size 1 it fails the
  check in `megatron/training/arguments.py` that the split's stage count equals the pipeline size,
  and a pure-fabric run passes no split, so the fabrics are modelled with pipeline 1.)
- GPT-7.5B: no script in the repository runs it. `examples/pretrain_gpt_4_nodes.sh` runs the
  39.1B model (48 layers, hidden 8192) with tensor 8 x pipeline 2 (layers 26/22) and global batch
  1536: exactly the row of Megatron-LM's published scaling table for 39.1B (model-parallel size 16,
  batch 1536; the table is images/cases_april2021.png in NVIDIA/Megatron-LM), with the pipeline
  of one stage per cluster that `--hetero-pipeline-stages 1 a 1 b` gives. The 7.5B layout is
  inferred the same way: the table's row for 7.5B (model-parallel size 4, batch 512, also the
  third row, as the paper's "parameter group 3" in the caption of `images/exp.png`) as pipeline 2 (one stage per cluster) x tensor
  2, so data parallel 16, with the scripts' micro batch 4: 8 microbatches a replica. The layer
  split is holmes_jax's cost-model split (`partition auto`, its self-adapting partition), as no
  split for this model is published.

The schedule of a paper layout is the better of holmes_jax's two (GPipe, 1F1B) for it; the
paper's Megatron ran 1F1B. Beside each paper layout the table prints, not as the target, the
layout holmes_jax's planner would pick for the same topology and batch, with its prediction.

What the figures price is holmes_jax's runtime, not the paper's frameworks, set up as close to
the paper's runs as it goes: what crosses `data` does so in 16 bits, as in the paper's fp16 runs
(`ParallelConfig.grad_reduce_dtype` and `update_gather_dtype` = 'bfloat16': the gradients'
reduce-scatter and ZeRO-1's gather of the updates, the same bytes as Megatron's 16-bit gradients
and parameters). The reference scripts run Megatron-LLaMA's overlapped distributed optimizer
(`--overlapped-distributed-optimizer`, a flag the published tree's own parser lacks: the scripts
are the paper's framework's), which reduce-scatters the gradients bucket by bucket during the
backward; holmes_jax reduces once a stage's ticks are done (the cost model's sync), so
communication-bound scenarios land below the paper.

One set of hardware constants for every scenario (HARDWARE below):

- A100: 312 TFLOP/s dense bf16 peak, 72% of it on a transformer layer: FlashAttention-2's
  published end-to-end GPT training speed, up to 225 TFLOP/s per A100 (Dao, 2023).
- NVLink 3: 2400 Gb/s per GPU each way, collectives at 80% (the topology default).
- InfiniBand node: 4 HDR HCAs of 200 Gb/s, 90% (RDMA, credit flow control). RoCE node: 2 HCAs of
  100 GbE, 60% (PFC pauses, congestion control). The HCA counts are Holmes' own cluster config
  (`config.json`: NCCL_IB_HCA lists 4 devices for IB, 2 for RoCE); the per-HCA rates are common
  parts of the time, not published with the paper.
- Ethernet: one 100 GbE port per node over NCCL's socket transport at 40%: NCCL's own issue
  tracker reports 4 to 6 GB/s all-reduce bus bandwidth of 12.5 GB/s on 4 nodes of 8 GPUs over
  100 Gb/s TCP after tuning (github.com/NVIDIA/nccl/issues/450). Clusters reach each other over
  this Ethernet (Holmes' config.json: the cross-cluster communicators use NCCL_NET=Socket).

TFLOPS per GPU are by Megatron's formula with recompute, as the planner reports them
(`predicted.flops_formula`); the paper's figure agrees with it (about 92 samples/s on 64 GPUs
for 7.5B is about 190 TFLOPS by this formula).

Targets, for the paper layouts: each figure within 20% of the paper's, RoCE/IB and Ethernet/IB
within 0.07 of the paper's ratios, and Holmes ahead of the NIC-blind layout on the mixed cluster.

    python bench/paper_scenarios.py

Last line: one JSON object: `ib_tflops`, `roce_tflops`, `eth_tflops`, `holmes_mixed_tflops`,
`naive_mixed_tflops` (the paper layouts' predicted TFLOPS per GPU), `layouts` and `planner` (each
scenario's paper layout and the planner's pick: mesh, microbatches, micro_batch, schedule,
stage_layers, tflops), `paper` (the paper's figures, as above) and `missed` (each target missed,
with by how much; empty when all are met).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from holmes_jax import cli
from holmes_jax.config import ModelConfig, ParallelConfig
from holmes_jax.planning import Plan, plan
from holmes_jax.planning.search import SEARCHABLE
from holmes_jax.planning.topology import Cluster, Topology, nic_link

HARDWARE = {
    "device_tflops": 312.0, "device_efficiency": 0.72, "intra_node_gbps": 2400.0,
    "hcas_per_node": {"infiniband": 4, "roce": 2, "ethernet": 1},
    "hca_gbps": {"infiniband": 200.0, "roce": 100.0, "ethernet": 100.0},
    "efficiency": {"infiniband": 0.90, "roce": 0.60, "ethernet": 0.40},
    "seq_len": 2048,
}
PAPER = {"ib_tflops": 197.0, "roce_tflops": 160.0, "eth_tflops": 122.0,
         "holmes_mixed_tflops": 195.0, "naive_mixed_tflops": 145.0}
TOLERANCE, RATIO_TOLERANCE = 0.20, 0.07


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a paper run fixes: the model's split over devices and the batch (see the module doc)."""

    tp: int
    pp: int
    micro_batch: int
    global_batch: int


PAPER_LAYOUTS = {
    "3.6b": Layout(tp=1, pp=1, micro_batch=4, global_batch=512),  # examples/pretrain_gpt_2_nodes.sh
    "7.5b": Layout(tp=2, pp=2, micro_batch=4, global_batch=512),  # inferred: no script runs 7.5B
}


def topology(*clusters: tuple[str, int]) -> Topology:
    """Clusters of (NIC class, nodes) of 8 A100s, joined by the Ethernet."""
    hw = HARDWARE

    def fabric(nic: str) -> dict:
        return dict(nic_gbps=hw["hcas_per_node"][nic] * hw["hca_gbps"][nic], nic_efficiency=hw["efficiency"][nic])

    return Topology(tuple(
        Cluster(nic, nic, nodes=nodes, devices_per_node=8, device_tflops=hw["device_tflops"],
                device_efficiency=hw["device_efficiency"], intra_node_gbps=hw["intra_node_gbps"], **fabric(nic))
        for nic, nodes in clusters),
        nic_link("ethernet", hw["hca_gbps"]["ethernet"], efficiency=hw["efficiency"]["ethernet"]),
        "+".join(n for n, _ in clusters))


# 16 bits over `data`, as the paper's fp16 runs: gradients reduced, updates gathered
WIRE = {"grad_reduce_dtype": "bfloat16", "update_gather_dtype": "bfloat16"}


def _model(name: str) -> ModelConfig:
    return ModelConfig(preset=name, compute_dtype="bfloat16", remat=True)


def paper_plan(model: str, topo: Topology, placement: str = "holmes") -> Plan:
    """The paper's layout for `model` on `topo`: sizes fixed, only the schedule chosen."""
    lay = PAPER_LAYOUTS[model]
    dp = topo.num_devices // (lay.tp * lay.pp)
    par = ParallelConfig(tp=lay.tp, pp=lay.pp, dp=dp, microbatches=lay.global_batch // (dp * lay.micro_batch),
                         placement=placement, **WIRE)
    return plan(topo, _model(model), par, auto=("schedule",), global_batch=lay.global_batch,
                seq_len=HARDWARE["seq_len"])


def planner_plan(model: str, topo: Topology, placement: str = "holmes") -> Plan:
    """What holmes_jax's planner picks for the same topology and batch: every size searched."""
    return plan(topo, _model(model), ParallelConfig(placement=placement, **WIRE),
                auto=SEARCHABLE, global_batch=PAPER_LAYOUTS[model].global_batch, seq_len=HARDWARE["seq_len"])


SCENARIOS = {  # key: (label, model, clusters, placement)
    "ib": ("GPT-3.6B, 4 InfiniBand nodes", "3.6b", (("infiniband", 4),), "holmes"),
    "roce": ("GPT-3.6B, 4 RoCE nodes", "3.6b", (("roce", 4),), "holmes"),
    "eth": ("GPT-3.6B, 4 Ethernet nodes", "3.6b", (("ethernet", 4),), "holmes"),
    "holmes_mixed": ("GPT-7.5B, 4 IB + 4 RoCE, Holmes", "7.5b", (("infiniband", 4), ("roce", 4)), "holmes"),
    "naive_mixed": ("GPT-7.5B, 4 IB + 4 RoCE, NIC-blind", "7.5b", (("infiniband", 4), ("roce", 4)), "naive"),
}


def _layout(p: Plan) -> dict:
    return {"mesh": p.mesh, "microbatches": p.microbatches, "micro_batch": p.micro_batch, "schedule": p.schedule,
            "stage_layers": list(p.stage_layers), "tflops": round(p.prediction.tflops_per_device, 1)}


def _row(p: Plan) -> str:
    mesh = "/".join(map(str, p.mesh.values()))
    return (f"{mesh:>8} {p.microbatches:>3}x{p.micro_batch:<2} {p.schedule:>5} "
            f"{','.join(map(str, p.stage_layers)):>17} {p.prediction.tflops_per_device:>6.1f}")


def run() -> dict:
    """Prints the table; returns the paper layouts' figures, and both layouts of each scenario."""
    plans = {}
    for key, (_, model, clusters, placement) in SCENARIOS.items():
        topo = topology(*clusters)
        plans[key] = paper_plan(model, topo, placement), planner_plan(model, topo, placement)
    print(f"TFLOPS per GPU by {plans['ib'][0].flops_formula}; hardware: {json.dumps(HARDWARE)}\n")
    head = f"{'s/d/t':>8} {'m x mb':>6} {'sched':>5} {'layers/stage':>17} {'TFLOPS':>6}"
    print(f"{'':<36} {'the paper layout':-^46} {'':<13} {'the planner picks':-^46}")
    print(f"{'scenario':<36} {head} {'paper':>6} {'off':>5}  {head}")
    figures, layouts, planner = {}, {}, {}
    for key, (label, *_) in SCENARIOS.items():
        ours, best = plans[key]
        figures[f"{key}_tflops"] = round(ours.prediction.tflops_per_device, 1)
        layouts[key], planner[key] = _layout(ours), _layout(best)
        paper = PAPER[f"{key}_tflops"]
        print(f"{label:<36} {_row(ours)} {paper:>6.0f} {figures[f'{key}_tflops'] / paper - 1:>+5.0%}  {_row(best)}")
    return {**figures, "layouts": layouts, "planner": planner}


def misses(figures: dict) -> list[str]:
    """The targets the figures miss, each with by how much (empty when all are met)."""
    found = []
    for key, paper in PAPER.items():
        off = figures[key] / paper - 1
        if abs(off) > TOLERANCE:
            found.append(f"{key} {figures[key]} is {off:+.0%} off the paper's {paper:g} (allowed +-{TOLERANCE:.0%})")
    for key in ("roce", "eth"):
        ours, theirs = figures[f"{key}_tflops"] / figures["ib_tflops"], PAPER[f"{key}_tflops"] / PAPER["ib_tflops"]
        if abs(ours - theirs) > RATIO_TOLERANCE:
            found.append(f"{key}/ib ratio {ours:.2f} vs the paper's {theirs:.2f} (allowed +-{RATIO_TOLERANCE})")
    if figures["holmes_mixed_tflops"] <= figures["naive_mixed_tflops"]:
        found.append("Holmes on the mixed cluster is not ahead of the NIC-blind layout")
    return found


def main(argv: list[str]) -> None:
    # no flags: any is a mistake
    cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    figures = run()
    ratios = {k: round(figures[f"{k}_tflops"] / figures["ib_tflops"], 2) for k in ("roce", "eth")}
    print(f"\nratios to pure IB: RoCE {ratios['roce']} (paper {PAPER['roce_tflops'] / PAPER['ib_tflops']:.2f}), "
          f"Ethernet {ratios['eth']} (paper {PAPER['eth_tflops'] / PAPER['ib_tflops']:.2f})")
    missed = misses(figures)
    print("targets (the paper layouts): " + ("all met" if not missed else "missed: " + "; ".join(missed)))
    print(json.dumps({**figures, "paper": PAPER, "missed": missed}))


if __name__ == "__main__":
    cli.run(main)
