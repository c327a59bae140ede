"""The headline benchmark: Holmes' placement and partition against a NIC-blind layout, measured
side by side on the emulated heterogeneous-NIC testbed (holmes_jax.emulate; root only).

Testbed: 2 clusters of 2 hosts (network namespaces), one process per host with 1 CPU device:
"ib" hosts' NICs shaped to 2000 Mbit/s, "roce" hosts' to 1000 Mbit/s, each cluster's uplink to
200 Mbit/s (shared by its 2 hosts: 100 Mbit/s each when both send). Configurations, each a real
`python -m holmes_jax.train` run of STEPS steps (pp 2, dp 2, GPipe, 4 microbatches):

  (a) homogeneous fast network (every NIC and the uplinks at 2000 Mbit/s), Holmes placement
  (b) heterogeneous network, naive placement: each stage's data group spans the slow uplink
  (c) heterogeneous, Holmes placement (stage 0 on ib, stage 1 on roce), uniform partition
  (d) heterogeneous, Holmes placement, auto partition from a profile measured in the cluster

The model (8 layers, hidden 192) and the uplink are sized with the ring all-reduce formula 2(n-1)/n * S/W: a stage's
gradients (4 layers x 0.44 M parameters x 4 B = 7.1 MB) take about 0.57 s to sync over a
100 Mbit/s share of the uplink (ZeRO-1 reduce-scatter + all-gather over a ring of 2: S/W), while
the pipeline's hops across it (micro batch 1 x seq 64 x hidden 192 x 4 B = 49 KB from each of the
2 hosts at once, 8 per step: GPipe moves activations in its 4 forward ticks and gradients in its
4 backward ticks) take about 4 ms each, 31 ms a step; inside the ib cluster the sync takes about
30 ms. Both targets pull the uplink's rate apart: at 100 Mbit/s the hops alone cost (d) 16% of
(a)'s step, at 300 Mbit/s the naive sync no longer doubles it.

Predictions: the plan's step time, from the topology TOML written here (NIC Gb/s = the shaped
rates, efficiency = measured TCP throughput / shaped rate, the inter-cluster link per host = the
uplink's share) and a profile measured on each testbed (`python -m holmes_jax.profile`,
all 4 processes at once, so CPU sharing is in the layer times). (a), (c) and (d) use their
testbed's whole profile (their layout is the profiled one); (b) uses the heterogeneous profile's
layer times only, links from the topology (its data groups are not the profiled ones).

Run (root): python bench/hetero_nic.py     Last line: one JSON object of the figures.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from holmes_jax import emulate

CLUSTERS = [("ib", "infiniband", 2), ("roce", "roce", 2)]
IB_MBIT, ROCE_MBIT, INTER_MBIT = 2000.0, 1000.0, 200.0
STEPS = 16
WARMUP_STEPS = 4  # not timed: the first steps run slower (allocations, TCP windows opening)
MODEL = {"preset": "tiny", "num_layers": 8, "hidden": 192, "num_heads": 4, "ffn_hidden": 768}
SEQ, GLOBAL_BATCH, MICROBATCHES = 64, 8, 4
RUN_TIMEOUT_S = 300


def gin_args(workdir: Path, topology: Path, placement: str, partition: str, profile: Path | None) -> list[str]:
    args = [f"--gin.ModelConfig.{k}={v}" for k, v in MODEL.items()] + [
        "--gin.ParallelConfig.pp=2", "--gin.ParallelConfig.dp=2", "--gin.ParallelConfig.tp=1",
        f"--gin.ParallelConfig.microbatches={MICROBATCHES}", "--gin.ParallelConfig.schedule=gpipe",
        "--gin.ParallelConfig.cpu_devices=1", f"--gin.ParallelConfig.topology={topology}",
        f"--gin.ParallelConfig.placement={placement}", f"--gin.ParallelConfig.partition={partition}",
        f"--gin.DataConfig.seq_len={SEQ}", f"--gin.DataConfig.global_batch={GLOBAL_BATCH}",
        f"--gin.TrainConfig.steps={STEPS}", "--gin.TrainConfig.log_every=1", "--gin.TrainConfig.eval_every=100000",
        "--gin.TrainConfig.eval_batches=1", "--gin.TrainConfig.warmup_steps=1", f"--gin.TrainConfig.workdir={workdir}",
        "--gin.CheckpointConfig.enabled=False",
    ]
    if profile is not None:
        args.append(f"--gin.ParallelConfig.profile={profile}")
    return args


def topology_toml(ib_mbit: float, roce_mbit: float, inter_mbit: float, efficiency: dict, tflops: float) -> str:
    hosts = CLUSTERS[0][2]
    clusters = "".join(
        f'[[cluster]]\nname = "{name}"\nnic = "{nic}"\nnic_gbps = {mbit / 1000}\nnic_efficiency = {efficiency["intra"]:.4f}\n'
        f"nic_latency_us = 100\nnodes = {count}\ndevices_per_node = 1\ndevice_tflops = {tflops:.6g}\n"
        f"device_efficiency = 1.0\n\n"
        for (name, nic, count), mbit in zip(CLUSTERS, (ib_mbit, roce_mbit)))
    return (f"# Written by bench/hetero_nic.py: the emulated cluster (rates in Gb/s = the shaped Mbit/s / 1000).\n"
            f"{clusters}[inter_cluster]\nnic = \"ethernet\"\n"
            f"gbps = {inter_mbit / hosts / 1000}  # the {inter_mbit:g} Mbit/s uplink shared by {hosts} hosts\n"
            f"efficiency = {efficiency['inter']:.4f}\nlatency_us = 100\n")


def run(ec: emulate.EmulatedCluster, module_args: list[str], pin: bool) -> int:
    cmd = [sys.executable, "-m", *module_args]
    if pin:  # one core per process: rank r on core r
        cmd = ["sh", "-c", 'exec taskset -c "$HOLMES_PROCESS_ID" "$@"', "pin", *cmd]
    return ec.run(cmd, devices_per_process=1, timeout_s=RUN_TIMEOUT_S)


def measure_profile(ec: emulate.EmulatedCluster, path: Path, workdir: Path, topology: Path, pin: bool):
    """The profile of the Holmes layout, measured by all processes in `ec`; None if that failed."""
    from holmes_jax.planning.measured import Profile

    t = time.perf_counter()
    rc = run(ec, ["holmes_jax.profile", "--out", str(path), "--repeats", "5",
                  *gin_args(workdir, topology, "holmes", "uniform", None)], pin)
    if rc:
        print(f"hetero_nic: the profile run ({path.name}) failed with status {rc}", file=sys.stderr)
        return None
    prof = Profile.load(path)
    print(f"hetero_nic: {path.name} in {time.perf_counter() - t:.0f} s: layer fwd {prof.layer_fwd_s * 1e3:.2f} ms, "
          f"bwd {prof.layer_bwd_s * 1e3:.2f} ms; data groups "
          + ", ".join(f"{l.gbps * 1e3:.0f} Mbit/s + {l.latency_s * 1e3:.2f} ms" if l else "-" for l in prof.data_links)
          + "; boundary " + ", ".join(f"{l.gbps * 1e3:.0f} Mbit/s + {l.latency_s * 1e3:.2f} ms" for l in prof.stage_links),
          flush=True)
    return prof


def train(ec: emulate.EmulatedCluster, key: str, workdir: Path, topology: Path, placement: str, partition: str,
          profile: Path, pin: bool) -> float | None:
    """Configuration `key` trained in `ec`: its median step time after the warm-up; None if it failed."""
    t = time.perf_counter()
    rc = run(ec, ["holmes_jax.train", *gin_args(workdir, topology, placement, partition, profile)], pin)
    if rc:
        print(f"hetero_nic: run ({key}) failed with status {rc}", file=sys.stderr)
        return None
    print(f"hetero_nic: ({key}) done in {time.perf_counter() - t:.0f} s", flush=True)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return float(statistics.median(r["step_time_s"] for r in rows[WARMUP_STEPS:]))


def main() -> int:
    reason = emulate.unavailable_reason()
    if reason:
        print(f"bench/hetero_nic.py: cannot run: the emulated cluster {reason}", file=sys.stderr)
        return 1
    from holmes_jax import metrics
    from holmes_jax.config import ModelConfig, ParallelConfig
    from holmes_jax.planning import plan

    # A SIGTERM unwinds through the with-blocks below, so the namespaces are torn down.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    cores = os.cpu_count() or 1
    hosts = sum(c[2] for c in CLUSTERS)
    pin = cores >= hosts
    print(f"hetero_nic: {hosts} emulated hosts (1 process, 1 CPU device each) on {cores} CPU cores: "
          + ("each process pinned to its own core (taskset)" if pin else
             f"not pinned: {hosts} processes share {cores} cores, so compute times include that sharing "
             f"(the profile is measured the same way, all {hosts} processes at once)"), flush=True)
    import jax

    tflops = metrics.measure_matmul_peak_tflops(jax.devices()[:1])
    t_start = time.perf_counter()
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="hetero_nic-") as tmp:
        tmp = Path(tmp)
        model = ModelConfig(**MODEL)

        def predict(topology: Path, placement: str, partition: str, profile) -> tuple[float, tuple]:
            par = ParallelConfig(pp=2, dp=2, tp=1, microbatches=MICROBATCHES, schedule="gpipe",
                                 placement=placement, partition=partition, cpu_devices=1)
            p = plan(topology, model, par, global_batch=GLOBAL_BATCH, seq_len=SEQ, profile=profile)
            return p.prediction.step_time_s, p.stage_layers

        # Heterogeneous testbed: bandwidths, profile, then (b), (c), (d).
        with emulate.EmulatedCluster(CLUSTERS, {"infiniband": IB_MBIT, "roce": ROCE_MBIT}, INTER_MBIT) as ec:
            ib0, ib1, roce0, roce1 = ec.hosts
            intra, inter = ec.bandwidth_mbit(ib0, ib1), ec.bandwidth_mbit(ib1, roce1)
            eff = {"intra": min(intra / IB_MBIT, 1.0), "inter": min(inter / INTER_MBIT, 1.0)}
            print(f"hetero_nic: measured TCP ib-0 -> ib-1 {intra:.0f} of {IB_MBIT:g} Mbit/s, ib-1 -> roce-1 "
                  f"{inter:.0f} of {INTER_MBIT:g} Mbit/s (efficiencies in the topology)", flush=True)
            hetero = tmp / "hetero.toml"
            hetero.write_text(topology_toml(IB_MBIT, ROCE_MBIT, INTER_MBIT, eff, tflops))
            profile_path = tmp / "profile.json"
            prof = measure_profile(ec, profile_path, tmp / "profile-run", hetero, pin)
            if not prof:
                return 1
            layers_only = tmp / "profile-layers.json"
            layers_only.write_text(dataclasses.replace(prof, data_links=(), stage_links=()).to_json())
            configs = {"b": ("naive", "uniform", layers_only), "c": ("holmes", "uniform", profile_path),
                       "d": ("holmes", "auto", profile_path)}
            for key, (placement, partition, profile) in configs.items():
                predicted, layers = predict(hetero, placement, partition, profile)
                measured = train(ec, key, tmp / f"run-{key}", hetero, placement, partition, profile, pin)
                if measured is None:
                    return 1
                out[key] = (measured, predicted, layers)

        # Homogeneous fast testbed: its own profile, then (a).
        fast = {"infiniband": IB_MBIT, "roce": IB_MBIT}
        with emulate.EmulatedCluster(CLUSTERS, fast, IB_MBIT) as ec:
            homo = tmp / "homogeneous.toml"
            homo.write_text(topology_toml(IB_MBIT, IB_MBIT, IB_MBIT, {"intra": eff["intra"], "inter": eff["intra"]},
                                          tflops))
            fast_profile = tmp / "profile-homogeneous.json"
            if not measure_profile(ec, fast_profile, tmp / "profile-homogeneous-run", homo, pin):
                return 1
            predicted, layers = predict(homo, "holmes", "uniform", fast_profile)
            measured = train(ec, "a", tmp / "run-a", homo, "holmes", "uniform", fast_profile, pin)
            if measured is None:
                return 1
            out["a"] = (measured, predicted, layers)

    names = {"a": "a_homogeneous_s", "b": "b_naive_s", "c": "c_holmes_uniform_s", "d": "d_holmes_auto_s"}
    what = {"a": "homogeneous 2000 Mbit/s", "b": "hetero, naive", "c": "hetero, holmes, uniform",
            "d": "hetero, holmes, auto+profile"}
    tokens = GLOBAL_BATCH * SEQ
    print()
    print(f"{'config':<32} {'layers':<8} {'measured':>10} {'tokens/s':>10} {'predicted':>10} {'pred/meas':>9}")
    for k in "abcd":
        meas, pred, layers = out[k]
        print(f"({k}) {what[k]:<28} {','.join(map(str, layers)):<8} {meas * 1e3:>8.0f} ms {tokens / meas:>10.0f} "
              f"{pred * 1e3:>7.0f} ms {pred / meas:>9.2f}")
    m = {k: out[k][0] for k in "abcd"}
    p = {k: out[k][1] for k in "abcd"}
    print()
    print(f"speedup (b)/(c) holmes uniform over naive: {m['b'] / m['c']:.2f}x (predicted {p['b'] / p['c']:.2f}x)")
    print(f"speedup (b)/(d) holmes auto over naive:    {m['b'] / m['d']:.2f}x (predicted {p['b'] / p['d']:.2f}x)"
          f"  target >= 2x: {'met' if m['b'] / m['d'] >= 2 else 'NOT met'}")
    print(f"(a)/(d) holmes auto vs homogeneous:        {m['a'] / m['d']:.2f}x (predicted {p['a'] / p['d']:.2f}x)"
          f"  target (d) within 15% of (a): {'met' if m['d'] <= 1.15 * m['a'] else 'NOT met'}")
    worst = max(abs(p[k] / m[k] - 1) for k in "abcd")
    print(f"worst prediction error {worst * 100:.0f}%  target <= 25%: {'met' if worst <= 0.25 else 'NOT met'}")
    print(f"bench wall time {time.perf_counter() - t_start:.0f} s")
    result = {names[k]: round(m[k], 5) for k in "abcd"}
    result["predicted_s"] = {names[k]: round(p[k], 5) for k in "abcd"}
    result["stage_layers"] = {names[k]: list(out[k][2]) for k in "abcd"}
    result["speedup_c_over_b"] = round(m["b"] / m["c"], 3)
    result["speedup_d_over_b"] = round(m["b"] / m["d"], 3)
    result["speedup_d_over_a"] = round(m["a"] / m["d"], 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
