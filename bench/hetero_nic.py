"""The headline benchmark: Holmes' placement and partition against a NIC-blind layout, measured
side by side on the emulated heterogeneous-NIC testbed (holmes_jax.emulate; root only).

Testbed: 2 clusters of 2 hosts (network namespaces), one process per host with 1 CPU device:
"ib" hosts' NICs shaped to 2000 Mbit/s, "roce" hosts' to 200 Mbit/s (10x slower, as the paper's
InfiniBand against its slowest class), each cluster's uplink to 100 Mbit/s (shared by its 2
hosts). Every process is capped at cores / hosts CPUs (cgroup), so a stage that idles does not
lend its time to the other: the hosts behave as devices of a fixed speed, as the cost model
assumes. Each configuration is a real `python -m holmes_jax.train` run of STEPS steps (pp 2,
dp 2, GPipe, 4 microbatches, 16 layers), launched ROUNDS = 2 times in interleaved rounds
((b) (c) (d) (e), then again) and timed as the median of both launches' steps after the
warm-up, because two launches of one configuration can be 11% apart on a shared machine ((f)'s
in README's run 15: 1357 and 1213 ms), more than the margins of (d)/(c) and (g)/(f):

  (a) homogeneous fast network (every NIC and the uplinks at 2000 Mbit/s), Holmes placement
  (b) heterogeneous network, naive placement: each stage's data group spans the slow uplink
  (c) heterogeneous, Holmes placement (stage 0 on ib, stage 1 on roce), uniform partition
  (d) heterogeneous, Holmes placement, auto partition from a profile measured in the cluster
  (e) heterogeneous, Holmes placement, Holmes' own rule: layers in proportion to NIC Gb/s
  (f) fast network, the roce cluster's processes capped at half the others' CPU time, uniform
  (g) as (f), auto partition from a profile measured on that testbed (it times each stage)

The profiles behind (d) and (g) also time the model's own step at the 3 splits the plan ranks
fastest (`--splits 3`); `auto` takes the fastest of them, and the plan's prediction of that
split is what is compared.

Sized with the cost model before measuring (`docs/uneven.md`): a roce stage's gradients cost
about 95 ms per layer to reduce and gather at 200 Mbit/s, well above a layer's share of the
pipeline (~55 ms), so moving layers to the ib stage pays; the uplink's hops (49 KB each, 8 a
step) stay near 10 ms each. (f)/(g) leave out when the machine cannot cap a process's CPU time.

Predictions: the plan's step time, from the topology TOML written here (NIC Gb/s = the shaped
rates, efficiency = measured TCP throughput / shaped rate, the inter-cluster link per host = the
uplink's share) and a profile measured on each testbed (`python -m holmes_jax.profile`,
all 4 processes at once, whole steps at two depths included) on the layout it predicts: (a),
(c)-(g) the Holmes layout's on their testbed, (b) the naive layout's, whose data groups cross
the uplink (gloo's ring sends both ways at once, and a shaped link carrying data one way and the
other flow's acks back gives TCP less than a one-way transfer measures: 51-92 Mbit/s against 94
of 100).

Run (root): python bench/hetero_nic.py     Last line: one JSON object of the figures: the measured
step times in seconds a_homogeneous_s, b_naive_s, c_holmes_uniform_s, d_holmes_auto_s,
e_holmes_ratio_s (and f_slow_devices_uniform_s, g_slow_devices_auto_s where CPU caps work),
predicted_s and stage_layers (each keyed by the same names), auto_stage_layers (d's) and
slow_auto_stage_layers (g's). Targets: (d) <= 0.87 (c) with an uneven split, (d) <= (e),
(b)/(d) >= 2.5, (d)/(a) <= 1.10, every prediction within 15%, (g) <= 0.85 (f).
Sizing (no root): python bench/hetero_nic.py --size   The cost model's (a)-(e) for candidate rates.
A stop (Ctrl-C, SIGTERM, SIGHUP) tears the testbed down and exits 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from holmes_jax import cli, emulate

CLUSTERS = [("ib", "infiniband", 2), ("roce", "roce", 2)]
IB_MBIT, ROCE_MBIT, INTER_MBIT = 2000.0, 200.0, 100.0
STEPS = 16
WARMUP_STEPS = 4  # not timed: the first steps run slower (allocations, TCP windows opening)
MODEL = {"preset": "tiny", "num_layers": 16, "hidden": 192, "num_heads": 4, "ffn_hidden": 768}
SEQ, GLOBAL_BATCH, MICROBATCHES = 64, 8, 4
RUN_TIMEOUT_S = 600
PROFILE_TIMEOUT_S = 1800  # a profile that times 3 splits, each in 2 rounds, takes ~12 min on the slow testbed
SLOW_SHARE = 0.5  # (f), (g): the roce cluster's processes get this share of the others' CPU time
AUTO_SPLITS_TIMED = 3  # the profiles behind (d) and (g) time the model at the plan's best 3 splits
ROUNDS = 2  # each testbed's configurations are launched this many times, interleaved, and their steps pooled


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


@dataclasses.dataclass
class Testbed:
    """An emulated cluster and how its processes run: pinned to a core each (rank r to cores[r]),
    or not (no cores), and CPU-capped or not."""

    ec: emulate.EmulatedCluster
    cores: tuple[int, ...]
    cpu: emulate.CpuLimits | None = None


def run(bed: Testbed, module_args: list[str], timeout_s: float = RUN_TIMEOUT_S) -> int:
    cmd = [sys.executable, "-m", *module_args]
    if bed.cores:  # one core per process: rank r on the r-th of the cores listed
        listed = ",".join(map(str, bed.cores))
        cmd = ["sh", "-c", f'exec taskset -c "$(echo {listed} | cut -d, -f$((HOLMES_PROCESS_ID + 1)))" "$@"', "pin", *cmd]
    rc = bed.ec.run(cmd, devices_per_process=1, timeout_s=timeout_s, cpu=bed.cpu)
    if rc - 128 in cli.STOP_SIGNALS:  # Ctrl-C (or a TERM, HUP) passed on to the processes: we were stopped, not failed
        raise cli.Stopped(rc - 128, f"hetero_nic: stopped by {signal.Signals(rc - 128).name}")
    return rc


def measure_profile(bed: Testbed, path: Path, workdir: Path, topology: Path, placement: str = "holmes",
                    splits: int = 0):
    """The profile of `placement`'s layout, measured by all processes of `bed` (with `splits`:
    the model's own step at that many splits the plan ranks fastest); None if that failed."""
    from holmes_jax.planning.measured import Profile

    t = time.perf_counter()
    rc = run(bed, ["holmes_jax.profile", "--out", str(path), "--repeats", "5", "--splits", str(splits),
                   *gin_args(workdir, topology, placement, "uniform", None)], timeout_s=PROFILE_TIMEOUT_S)
    if rc:
        print(f"hetero_nic: the profile run ({path.name}) failed with status {rc}", file=sys.stderr)
        return None
    prof = Profile.load(path)
    timed = ", ".join(f"{list(p.stage_layers)} {p.step_s * 1e3:.0f} ms" for p in prof.split_probes)
    print(f"hetero_nic: {path.name} in {time.perf_counter() - t:.0f} s: layer fwd {prof.layer_fwd_s * 1e3:.2f} ms, "
          f"bwd {prof.layer_bwd_s * 1e3:.2f} ms; data groups "
          + ", ".join(f"{l.gbps * 1e3:.0f} Mbit/s + {l.latency_s * 1e3:.2f} ms" if l else "-" for l in prof.data_links)
          + "; boundary " + ", ".join(f"{l.gbps * 1e3:.0f} Mbit/s + {l.latency_s * 1e3:.2f} ms" for l in prof.stage_links)
          + "; stage layer times x " + (", ".join(f"{v:.2f}" for v in prof.stage_layer_scale) or "-")
          + "; steps " + ", ".join(f"{list(p.stage_layers)} {p.step_s * 1e3:.0f} ms" for p in prof.step_probes)
          + (f"; splits timed {timed}" if timed else ""), flush=True)
    return prof


def train(bed: Testbed, key: str, workdir: Path, topology: Path, placement: str, partition: str,
          profile: Path) -> list[float] | None:
    """Configuration `key` trained on `bed`: its step times after the warm-up; None if it failed."""
    t = time.perf_counter()
    rc = run(bed, ["holmes_jax.train", *gin_args(workdir, topology, placement, partition, profile)])
    if rc:
        print(f"hetero_nic: run ({key}) failed with status {rc}", file=sys.stderr)
        return None
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [float(r["step_time_s"]) for r in rows[WARMUP_STEPS:]]
    print(f"hetero_nic: ({key}) done in {time.perf_counter() - t:.0f} s, median step "
          f"{statistics.median(steps) * 1e3:.0f} ms", flush=True)
    return steps


NAMES = {"a": "a_homogeneous_s", "b": "b_naive_s", "c": "c_holmes_uniform_s", "d": "d_holmes_auto_s",
         "e": "e_holmes_ratio_s", "f": "f_slow_devices_uniform_s", "g": "g_slow_devices_auto_s"}
WHAT = {"a": f"homogeneous {IB_MBIT:g} Mbit/s", "b": "hetero, naive", "c": "hetero, holmes, uniform",
        "d": "hetero, holmes, auto+profile", "e": "hetero, holmes, holmes-ratio",
        "f": "slow roce CPUs, uniform", "g": "slow roce CPUs, auto+profile"}


# `--size`: the cost model's view of candidate testbeds before measuring, from a stand-in profile
# of this model on the 4-process testbed, as measured there (per layer and microbatch: forward 2.5 ms,
# backward 9.7 ms; a data group's sync reaches ~42% of a 2000 Mbit/s NIC's rate and ~75% of a
# slower one's (measured at 250), each after ~2.5 ms; a hop ~95% of the uplink's; the optimizer
# 5 ns a parameter).
STAND_IN = {"fwd_s": 2.5e-3, "bwd_s": 9.7e-3, "fast_nic_efficiency": 0.42, "slow_nic_efficiency": 0.75,
            "latency_s": 2.5e-3, "uplink_efficiency": 0.95, "update_s": 5e-9}


def size(candidates=((1000, 200), (500, 100), (250, 100), (200, 100), (200, 200), (160, 100), (125, 100))) -> None:
    """Prints the predicted (a)-(e) for each (roce Mbit/s, uplink Mbit/s) candidate."""
    from holmes_jax.config import ModelConfig, ParallelConfig
    from holmes_jax.models.presets import resolve
    from holmes_jax.planning import plan, workload
    from holmes_jax.planning.measured import Profile
    from holmes_jax.planning.topology import Link

    cfg = ModelConfig(**MODEL)
    micro_batch = GLOBAL_BATCH // (2 * MICROBATCHES)
    flops = workload.model_costs(resolve(cfg), micro_batch, SEQ).layers[0].fwd_flops
    sin = STAND_IN

    def data_link(mbit):
        efficiency = sin["fast_nic_efficiency"] if mbit >= IB_MBIT else sin["slow_nic_efficiency"]
        return Link(mbit * efficiency * 1e6 / 8, sin["latency_s"])

    print(f"{'roce':>6} {'uplink':>6} | " + " ".join(f"{k:>6}" for k in "abcde") + " | d layers  e layers | "
          "d/c   d/e   b/d   d/a  | hop")
    with tempfile.TemporaryDirectory() as tmp:
        for roce, uplink in candidates:
            row = {}
            for key, (ib_r, roce_r, up, placement, partition) in {
                    "a": (IB_MBIT, IB_MBIT, IB_MBIT, "holmes", "uniform"), "b": (IB_MBIT, roce, uplink, "naive", "uniform"),
                    "c": (IB_MBIT, roce, uplink, "holmes", "uniform"), "d": (IB_MBIT, roce, uplink, "holmes", "auto"),
                    "e": (IB_MBIT, roce, uplink, "holmes", "holmes-ratio")}.items():
                topo = Path(tmp) / "t.toml"
                topo.write_text(topology_toml(ib_r, roce_r, up, {"intra": sin["fast_nic_efficiency"],
                                                                 "inter": sin["uplink_efficiency"]}, 0.05))
                links = () if key == "b" else (data_link(ib_r), data_link(roce_r))
                hop = Link(up / CLUSTERS[0][2] * sin["uplink_efficiency"] * 1e6 / 8, 0.5e-3)
                prof = Profile("stand-in", micro_batch, SEQ, flops, sin["fwd_s"], sin["bwd_s"], links, (hop,),
                               sin["update_s"])
                par = ParallelConfig(pp=2, dp=2, tp=1, microbatches=MICROBATCHES, schedule="gpipe",
                                     placement=placement, partition=partition, cpu_devices=1)
                row[key] = plan(topo, cfg, par, global_batch=GLOBAL_BATCH, seq_len=SEQ, profile=prof)
            t = {k: p.prediction.step_time_s for k, p in row.items()}
            print(f"{roce:>6} {uplink:>6} | " + " ".join(f"{t[k] * 1e3:>6.0f}" for k in "abcde")
                  + f" | {','.join(map(str, row['d'].stage_layers)):<9} {','.join(map(str, row['e'].stage_layers)):<8}"
                  f" | {t['d'] / t['c']:.2f}  {t['d'] / t['e']:.2f}  {t['b'] / t['d']:.2f}  {t['d'] / t['a']:.2f}"
                  f" | {row['d'].prediction.p2p_s[0] * 1e3:.0f} ms")


def main(argv: list[str]) -> int:
    parser = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", action="store_true",
                        help="print the cost model's (a)-(e) for candidate rates instead (no root, no run)")
    if parser.parse_args(argv).size:
        size()
        return 0
    reason = emulate.unavailable_reason()
    if reason:
        print(f"bench/hetero_nic.py: cannot run: the emulated cluster {reason}", file=sys.stderr)
        return 1
    from holmes_jax.config import ModelConfig, ParallelConfig
    from holmes_jax.planning import plan

    # A stop unwinds through the with-blocks below, so the namespaces are torn down: during a launch
    # as cli.Stopped (see `run`), between launches as cli.run's SIGTERM / SIGHUP or Ctrl-C.
    # the cores this process may use (a container's cpuset need not start at core 0, and taskset
    # refuses a core outside it; os.cpu_count() counts the machine's)
    usable = sorted(os.sched_getaffinity(0))
    cores, hosts = len(usable), sum(c[2] for c in CLUSTERS)
    pinned = tuple(usable[:hosts]) if cores >= hosts else ()
    share = min(1.0, cores / hosts)  # each process's cap: hosts behave as devices of a fixed speed
    try:
        with emulate.CpuLimits([share] * hosts):
            capped = True
    except emulate.EmulationError as e:
        capped = False
        print(f"hetero_nic: no CPU caps ({e}): processes share the cores freely; (f) and (g) are left out", flush=True)
    print(f"hetero_nic: {hosts} emulated hosts (1 process, 1 CPU device each) on {cores} CPU cores: "
          + ("each process pinned to its own core (taskset)" if pinned else f"{hosts} processes share {cores} cores")
          + (f", each capped at {share:.2f} CPUs (cgroup), so an idle stage's time does not speed up another"
             if capped else ""), flush=True)
    # in a child process: JAX's threads in this one would be forked with every testbed process
    tflops = float(subprocess.run(
        [sys.executable, "-c", "import jax; from holmes_jax import metrics; "
                               "print(metrics.measure_matmul_peak_tflops(jax.devices()[:1]))"],
        capture_output=True, text=True, check=True).stdout.split()[-1])
    t_start = time.perf_counter()
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="hetero_nic-") as tmp:
        tmp = Path(tmp)
        model = ModelConfig(**MODEL)

        def predict(topology: Path, placement: str, partition: str, profile) -> tuple[float, tuple, object]:
            par = ParallelConfig(pp=2, dp=2, tp=1, microbatches=MICROBATCHES, schedule="gpipe",
                                 placement=placement, partition=partition, cpu_devices=1)
            p = plan(topology, model, par, global_batch=GLOBAL_BATCH, seq_len=SEQ, profile=profile)
            return p.prediction.step_time_s, p.stage_layers, p

        def configs(bed: Testbed, topology: Path, runs: dict) -> bool:
            """Each configuration of `runs` launched ROUNDS times, in interleaved rounds (so the
            testbed's drift over minutes falls on all of them alike): the median of the pooled steps."""
            steps: dict = {key: [] for key in runs}
            for round_ in range(ROUNDS):
                for key, (placement, partition, profile) in runs.items():
                    measured = train(bed, key, tmp / f"run-{key}-{round_}", topology, placement, partition, profile)
                    if measured is None:
                        return False
                    steps[key] += measured
            for key, (placement, partition, profile) in runs.items():
                predicted, layers, the_plan = predict(topology, placement, partition, profile)
                out[key] = (statistics.median(steps[key]), predicted, layers, the_plan)
            return True

        def cpu_caps(slow: float = 1.0):
            cpu = [share if c[0] == CLUSTERS[0][0] else share * slow for c in CLUSTERS for _ in range(c[2])]
            return emulate.CpuLimits(cpu) if capped else contextlib.nullcontext()

        # Heterogeneous testbed: bandwidths, profile, then (b), (c), (d), (e).
        with emulate.EmulatedCluster(CLUSTERS, {"infiniband": IB_MBIT, "roce": ROCE_MBIT}, INTER_MBIT) as ec, \
                cpu_caps() as cpu:
            bed = Testbed(ec, pinned, cpu)
            ib0, ib1, roce0, roce1 = ec.hosts
            intra, inter = ec.bandwidth_mbit(ib0, ib1), ec.bandwidth_mbit(ib1, roce1)
            eff = {"intra": min(intra / IB_MBIT, 1.0), "inter": min(inter / INTER_MBIT, 1.0)}
            print(f"hetero_nic: measured TCP ib-0 -> ib-1 {intra:.0f} of {IB_MBIT:g} Mbit/s, ib-1 -> roce-1 "
                  f"{inter:.0f} of {INTER_MBIT:g} Mbit/s (efficiencies in the topology)", flush=True)
            hetero = tmp / "hetero.toml"
            hetero.write_text(topology_toml(IB_MBIT, ROCE_MBIT, INTER_MBIT, eff, tflops))
            profile_path = tmp / "profile.json"
            prof = measure_profile(bed, profile_path, tmp / "profile-run", hetero, splits=AUTO_SPLITS_TIMED)
            if not prof:
                return 1
            naive_profile = tmp / "profile-naive.json"  # its data groups cross the uplink: measured too
            if not measure_profile(bed, naive_profile, tmp / "profile-naive-run", hetero, placement="naive"):
                return 1
            if not configs(bed, hetero, {"b": ("naive", "uniform", naive_profile),
                                         "c": ("holmes", "uniform", profile_path),
                                         "d": ("holmes", "auto", profile_path),
                                         "e": ("holmes", "holmes-ratio", profile_path)}):
                return 1

        # Homogeneous fast testbed: its own profile, then (a); then the roce cluster's CPUs slowed:
        # a profile that measures it, then (f) and (g).
        fast = {"infiniband": IB_MBIT, "roce": IB_MBIT}
        with emulate.EmulatedCluster(CLUSTERS, fast, IB_MBIT) as ec:
            homo = tmp / "homogeneous.toml"
            homo.write_text(topology_toml(IB_MBIT, IB_MBIT, IB_MBIT, {"intra": eff["intra"], "inter": eff["intra"]},
                                          tflops))
            with cpu_caps() as cpu:
                bed = Testbed(ec, pinned, cpu)
                fast_profile = tmp / "profile-homogeneous.json"
                if not measure_profile(bed, fast_profile, tmp / "profile-homogeneous-run", homo):
                    return 1
                if not configs(bed, homo, {"a": ("holmes", "uniform", fast_profile)}):
                    return 1
            if capped:
                with cpu_caps(SLOW_SHARE) as cpu:
                    bed = Testbed(ec, pinned, cpu)
                    slow_profile = tmp / "profile-slow.json"
                    if not measure_profile(bed, slow_profile, tmp / "profile-slow-run", homo, splits=AUTO_SPLITS_TIMED):
                        return 1
                    if not configs(bed, homo, {"f": ("holmes", "uniform", slow_profile),
                                               "g": ("holmes", "auto", slow_profile)}):
                        return 1

    keys = [k for k in "abcdefg" if k in out]
    tokens = GLOBAL_BATCH * SEQ
    print()
    print(f"{'config':<34} {'layers':<8} {'measured':>10} {'tokens/s':>10} {'predicted':>10} {'pred/meas':>9}")
    for k in keys:
        meas, pred, layers, _ = out[k]
        print(f"({k}) {WHAT[k]:<30} {','.join(map(str, layers)):<8} {meas * 1e3:>8.0f} ms {tokens / meas:>10.0f} "
              f"{pred * 1e3:>7.0f} ms {pred / meas:>9.2f}")
    for k in ("d", "g"):
        if k in out:
            print(f"\nplan of ({k}):\n{out[k][3].explain()}")
    m = {k: out[k][0] for k in keys}
    p = {k: out[k][1] for k in keys}

    def target(ok: bool) -> str:
        return "met" if ok else "NOT met"

    print()
    print(f"(d)/(c) auto over uniform:       {m['d'] / m['c']:.2f} (predicted {p['d'] / p['c']:.2f}), auto picks "
          f"{list(out['d'][2])}  target <= 0.87, uneven: {target(m['d'] <= 0.87 * m['c'] and len(set(out['d'][2])) > 1)}")
    print(f"(d)/(e) auto over holmes-ratio:  {m['d'] / m['e']:.2f} (predicted {p['d'] / p['e']:.2f})"
          f"  target <= 1: {target(m['d'] <= m['e'])}")
    print(f"(b)/(d) auto over naive:         {m['b'] / m['d']:.2f} (predicted {p['b'] / p['d']:.2f})"
          f"  target >= 2.5: {target(m['b'] / m['d'] >= 2.5)}")
    print(f"(d)/(a) auto vs homogeneous:     {m['d'] / m['a']:.2f} (predicted {p['d'] / p['a']:.2f})"
          f"  target <= 1.10: {target(m['d'] / m['a'] <= 1.10)}")
    if "g" in m:
        print(f"(g)/(f) slow CPUs, auto/uniform: {m['g'] / m['f']:.2f} (predicted {p['g'] / p['f']:.2f}), auto picks "
              f"{list(out['g'][2])}  target <= 0.85: {target(m['g'] <= 0.85 * m['f'])}")
    worst = max(abs(p[k] / m[k] - 1) for k in keys)
    print(f"worst prediction error {worst * 100:.0f}%  target <= 15%: {target(worst <= 0.15)}")
    print(f"bench wall time {time.perf_counter() - t_start:.0f} s")
    result = {NAMES[k]: round(m[k], 5) for k in keys}
    result["predicted_s"] = {NAMES[k]: round(p[k], 5) for k in keys}
    result["stage_layers"] = {NAMES[k]: list(out[k][2]) for k in keys}
    result["auto_stage_layers"] = list(out["d"][2])
    if "g" in out:
        result["slow_auto_stage_layers"] = list(out["g"][2])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    cli.run(main)
