"""GPipe against 1F1B where a stage's idle ticks cost time: two processes, one stage each, each
pinned to a core of its own.

In one process the CPU devices share the cores, so a stage that idles lends its core to the
other and the bubble hardly shows (bench/pipeline.py). Here each stage owns a core: the step
lasts the schedule's lockstep ticks, as on GPUs. Both schedules train the same model on the same
batch (pp 2, dp 1, 1 CPU device a process, gloo over loopback), in alternating rounds; each
figure is the median step time after the warm-up steps, the best of the rounds.

Beside them, the plan's prediction of each from a profile measured here first (`python -m
holmes_jax.profile`: layer times and the link between the stages), and the 1F1B / GPipe ratio of
both.

    python bench/schedules.py [--rounds 3] [--microbatches 8]

Last line: one JSON object: `microbatches`, `measured_s` and `predicted_s` (each schedule's step
time in seconds, by name), `ratio` (1F1B / GPipe: `measured` and `predicted`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from holmes_jax import cli, launch
from holmes_jax.config import ModelConfig, ParallelConfig
from holmes_jax.planning import plan
from holmes_jax.planning.topology import Cluster, Topology

MODEL = {"preset": "tiny", "num_layers": 8, "hidden": 256, "num_heads": 4, "ffn_hidden": 1024}
SEQ, MICRO_BATCH = 128, 4
STEPS, WARMUP_STEPS = 12, 4
SCHEDULES = ("gpipe", "1f1b")
PARTITION = "uniform"  # the runs and the predictions split the layers alike (the gin default and the planner's differ)


def gin_args(workdir: Path, schedule: str, m: int) -> list[str]:
    return [f"--gin.ModelConfig.{k}={v}" for k, v in MODEL.items()] + [
        "--gin.ParallelConfig.pp=2", "--gin.ParallelConfig.dp=1", "--gin.ParallelConfig.tp=1",
        f"--gin.ParallelConfig.microbatches={m}", f"--gin.ParallelConfig.schedule={schedule}",
        f"--gin.ParallelConfig.partition={PARTITION}", "--gin.ParallelConfig.cpu_devices=1",
        f"--gin.DataConfig.seq_len={SEQ}",
        f"--gin.DataConfig.global_batch={m * MICRO_BATCH}", f"--gin.TrainConfig.steps={STEPS}",
        "--gin.TrainConfig.log_every=1", "--gin.TrainConfig.eval_every=100000", "--gin.TrainConfig.eval_batches=1",
        "--gin.TrainConfig.warmup_steps=1", f"--gin.TrainConfig.workdir={workdir}",
        "--gin.CheckpointConfig.enabled=False",
    ]


def stage_cores() -> list[int]:
    """The two cores the stages are pinned to: the first two this process may use (a container's
    cpuset need not hold cores 0 and 1, and taskset refuses a core outside it)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise cli.RunError(f"schedules needs 2 cores, one a stage; this process may use only core {cores[0]}")
    return cores[:2]


def run(module_args: list[str]) -> None:
    cores = stage_cores()
    pin = lambda rank: ["taskset", "-c", str(cores[rank])]  # noqa: E731
    rc = launch.launch([sys.executable, "-m", *module_args], n=2, devices_per_process=1, wrap=pin, timeout_s=900)
    if rc - 128 in cli.STOP_SIGNALS:  # Ctrl-C (or a TERM, HUP) passed on to the processes: we were stopped, not failed
        raise cli.Stopped(rc - 128, f"schedules: stopped by {signal.Signals(rc - 128).name}")
    if rc:
        raise SystemExit(f"schedules: {module_args[0]} failed with status {rc}")


def step_s(workdir: Path, schedule: str, m: int) -> float:
    run(["holmes_jax.train", *gin_args(workdir, schedule, m)])
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return float(statistics.median(r["step_time_s"] for r in rows[WARMUP_STEPS:]))


def predicted_s(profile: Path, schedule: str, m: int) -> float:
    """The plan's step time from the profile measured here (its layer times and links)."""
    cluster = Cluster("local", "ethernet", nodes=2, devices_per_node=1)
    par = ParallelConfig(pp=2, dp=1, tp=1, microbatches=m, schedule=schedule, partition=PARTITION,
                         profile=str(profile))
    model = ModelConfig(**MODEL)
    p = plan(Topology((cluster,), name="local"), model, par, global_batch=m * MICRO_BATCH, seq_len=SEQ)
    return p.prediction.step_time_s


def main(argv: list[str]) -> int:
    ap = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=cli.positive_int, default=3)
    ap.add_argument("--microbatches", type=cli.positive_int, default=8)
    args = ap.parse_args(argv)
    m = args.microbatches
    with tempfile.TemporaryDirectory(prefix="schedules_") as tmp:
        tmp = Path(tmp)
        run(["holmes_jax.profile", "--out", str(tmp / "profile.json"), "--repeats", "5",
             *gin_args(tmp / "profile", "gpipe", m)])
        predicted = {s: predicted_s(tmp / "profile.json", s, m) for s in SCHEDULES}
        best = {s: float("inf") for s in SCHEDULES}
        for r in range(args.rounds):
            for s in SCHEDULES:
                t = time.perf_counter()
                best[s] = min(best[s], step_s(tmp / f"{s}{r}", s, m))
                print(f"schedules: round {r}, {s}: {best[s] * 1e3:.1f} ms best so far "
                      f"({time.perf_counter() - t:.0f} s)", flush=True)
    ratio = {"measured": best["1f1b"] / best["gpipe"], "predicted": predicted["1f1b"] / predicted["gpipe"]}
    print(f"\npp 2, {m} microbatches of {MICRO_BATCH} x {SEQ} tokens, one pinned core a stage")
    print(f"{'schedule':>8} {'measured ms':>11} {'predicted ms':>12}")
    for s in SCHEDULES:
        print(f"{s:>8} {best[s] * 1e3:>11.1f} {predicted[s] * 1e3:>12.1f}")
    print(f"1f1b / gpipe: measured {ratio['measured']:.3f}, predicted {ratio['predicted']:.3f}")
    print(json.dumps({"microbatches": m, "measured_s": best, "predicted_s": predicted,
                      "ratio": {k: round(v, 3) for k, v in ratio.items()}}))
    return 0


if __name__ == "__main__":
    cli.run(main)
