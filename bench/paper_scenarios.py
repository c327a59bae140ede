"""Predicted throughput of the Holmes paper's scenarios beside the paper's measurements.

GPT-7.5B (36 layers, hidden 4096, 32 heads, vocabulary 51200) on 64 A100s (8 nodes of 8), seq
2048, bf16 with activation recompute, tensor parallelism 8 inside a node, pipeline parallelism 2
(Holmes' two-cluster split), Megatron's 1F1B schedule, microbatches and layers per stage chosen by
the cost model, global batch 1024. TFLOPS per GPU by Megatron's formula with recompute: the
paper's own figures imply it (197 TFLOPS x 64 GPUs / 99.23 samples/s = 1.27e14 FLOPs a sample;
the recompute formula gives 1.31e14, the other 0.99e14).

Links are those of configs/topologies/*.toml and holmes_jax.planning.topology's class defaults:
InfiniBand HDR 200 Gb/s per node at 90% efficiency, RoCE 100 Gb/s at 60%, Ethernet (TCP) 25 Gb/s
at 80%; NVLink 2400 Gb/s per GPU at 80%; A100s reach 75% of their 312 TFLOP/s on a layer. In
ib4_roce4 the two clusters reach each other only over the 25 Gb/s Ethernet.

Run: python bench/paper_scenarios.py
"""

from __future__ import annotations

import json
from pathlib import Path

from holmes_jax.planning import workload
from holmes_jax.config import ModelConfig, ParallelConfig
from holmes_jax.planning import plan

TOPOLOGIES = Path(__file__).resolve().parent.parent / "configs" / "topologies"
MODEL = ModelConfig(preset="7.5b", compute_dtype="bfloat16", remat=True)
GLOBAL_BATCH = 1024
PAPER = {"ib": (197.0, 99.23), "roce": (160.0, 80.54), "eth": (122.0, 61.32)}  # TFLOPS/GPU, samples/s


def scenario(topology: str, placement: str = "holmes", partition: str = "auto", parallel: ParallelConfig | None = None):
    parallel = parallel or ParallelConfig(tp=8, pp=2, schedule="1f1b", placement=placement, partition=partition)
    return plan(TOPOLOGIES / f"{topology}.toml", MODEL, parallel, global_batch=GLOBAL_BATCH, auto={"microbatches"})


def main() -> None:
    runs = {
        "ib": ("pure InfiniBand (ib8)", scenario("ib8")),
        "roce": ("pure RoCE (roce8)", scenario("roce8")),
        "eth": ("pure Ethernet (eth8)", scenario("eth8")),
        "holmes_ib4_roce4": ("Holmes on 4 IB + 4 RoCE", scenario("ib4_roce4")),
        "holmes_uniform_ib4_roce4": ("  same, uniform layers", scenario("ib4_roce4", partition="uniform")),
        "naive_ib4_roce4": ("NIC-blind ranks on 4 IB + 4 RoCE", scenario("ib4_roce4", placement="naive")),
    }
    chosen = plan(TOPOLOGIES / "ib4_roce4.toml", MODEL, global_batch=GLOBAL_BATCH)
    runs["planner_ib4_roce4"] = ("planner's own layout, 4 IB + 4 RoCE", chosen)

    ib = runs["ib"][1].prediction.tflops_per_device
    print(f"GPT-7.5B, 64 A100s, seq 2048, global batch {GLOBAL_BATCH}, bf16 + recompute; "
          f"TFLOPS/GPU by {chosen.flops_formula}\n")
    print(f"{'scenario':<38} {'mesh s/d/t':>10} {'m':>4} {'layers':>8} {'TFLOPS':>7} {'paper':>6} "
          f"{'vs IB':>6} {'paper':>6} {'samples/s':>10} {'paper':>6}")
    figures = {}
    for key, (label, p) in runs.items():
        pr = p.prediction
        paper_tflops, paper_samples = PAPER.get(key, (None, None))
        paper_ratio = f"{paper_tflops / PAPER['ib'][0]:.2f}" if paper_tflops else "-"
        print(f"{label:<38} {'/'.join(map(str, p.mesh.values())):>10} {p.microbatches:>4} "
              f"{','.join(map(str, p.stage_layers)):>8} {pr.tflops_per_device:>7.1f} {paper_tflops or '-':>6} "
              f"{pr.tflops_per_device / ib:>6.2f} {paper_ratio:>6} {pr.samples_per_s:>10.2f} {paper_samples or '-':>6}")
        figures[f"{key}_tflops"] = round(pr.tflops_per_device, 2)
        figures[f"{key}_samples_per_s"] = round(pr.samples_per_s, 2)
        figures[f"{key}_vs_ib"] = round(pr.tflops_per_device / ib, 3)

    # Where the time of one IB-stage microbatch goes: FLOPs at the device's speed vs tensor-parallel all-reduces.
    p = runs["ib"][1]
    costs = workload.model_costs(p.model, p.micro_batch, p.seq_len)
    flops = sum(layer.fwd_flops + layer.bwd_flops for layer in costs.layers[: p.stage_layers[0]])
    compute = flops / (p.tp * p.placement.device_flops[0])
    total = p.prediction.stage_fwd_s[0] + p.prediction.stage_bwd_s[0]
    h = runs["holmes_ib4_roce4"][1].prediction
    print(f"\nstage 0 of pure IB, one microbatch: {total * 1e3:.0f} ms, of which tensor-parallel all-reduces "
          f"{(total - compute) * 1e3:.0f} ms ({(total - compute) / total:.0%})")
    print(f"Holmes on ib4_roce4: stage syncs {', '.join(f'{s:.2f} s' for s in h.stage_sync_s)} "
          f"(IB ring, RoCE ring); pure IB {runs['ib'][1].prediction.stage_sync_s[0]:.2f} s, "
          f"pure Ethernet {runs['eth'][1].prediction.stage_sync_s[0]:.2f} s")
    print("\nratios to pure IB: predicted RoCE {roce_vs_ib:.2f} (paper 0.81), Ethernet {eth_vs_ib:.2f} (paper 0.62), "
          "Holmes mixed {holmes_ib4_roce4_vs_ib:.2f}, NIC-blind mixed {naive_ib4_roce4_vs_ib:.2f}".format(**figures))
    print(f"absolute: predicted pure-IB TFLOPS are {ib / PAPER['ib'][0]:.0%} of the paper's")
    figures.update(paper_ib_tflops=PAPER["ib"][0], paper_roce_tflops=PAPER["roce"][0], paper_eth_tflops=PAPER["eth"][0],
                   global_batch=GLOBAL_BATCH)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
