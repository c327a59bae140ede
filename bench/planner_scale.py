"""Planning time from 8 to 8192 nodes of 8 devices, everything on auto.

Each topology is half InfiniBand, half RoCE nodes (two clusters, Ethernet between them); the model
is GPT-7.5B's shape (hidden 4096, 32 heads, bf16, recompute) with 32, 64 or 128 layers; tp, pp, dp,
microbatches, schedule and layers per stage are all chosen by the cost model. The global batch
grows with the cluster (2 sequences per node, at least 512) so large clusters have work to split.
Each plan starts with an empty simulation cache. Target: under 1 s at 1024 nodes.

    python bench/planner_scale.py

Last line: one JSON object, `seconds_by_nodes`: each node count's slowest plan over the layer
counts, in seconds.
"""

from __future__ import annotations

import argparse
import json
import time

from holmes_jax import cli
from holmes_jax.config import ModelConfig
from holmes_jax.planning.topology import Cluster, Topology
from holmes_jax.planning import cost
from holmes_jax.planning import plan

NODES = [2**k for k in range(3, 14)]  # 8 ... 8192
LAYERS = (32, 64, 128)


def main(argv: list[str]) -> None:
    # no flags: --help must not run it
    cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    print(f"{'nodes':>6} {'layers':>6} {'seconds':>8}  {'mesh s/d/t':>11} {'m':>4} {'schedule':>8} {'TFLOPS':>7}")
    worst = {}
    for nodes in NODES:
        topology = Topology((Cluster("ib", "infiniband", nodes // 2, 8), Cluster("roce", "roce", nodes // 2, 8)),
                            name=f"ib{nodes // 2}_roce{nodes // 2}")
        for layers in LAYERS:
            model = ModelConfig(preset="7.5b", num_layers=layers, compute_dtype="bfloat16", remat=True)
            cost._ticks.cache_clear()
            start = time.perf_counter()
            p = plan(topology, model, global_batch=max(512, 2 * nodes))
            seconds = time.perf_counter() - start
            worst[str(nodes)] = max(worst.get(str(nodes), 0.0), round(seconds, 4))
            print(f"{nodes:>6} {layers:>6} {seconds:>8.3f}  {'/'.join(map(str, p.mesh.values())):>11} "
                  f"{p.microbatches:>4} {p.schedule:>8} {p.prediction.tflops_per_device:>7.1f}", flush=True)
    print(f"\nworst at 1024 nodes: {worst['1024']:.3f} s (target < 1 s)")
    print(json.dumps({"seconds_by_nodes": worst}))


if __name__ == "__main__":
    cli.run(main)
