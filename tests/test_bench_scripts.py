"""The bench scripts' own logic, run through their functions (bench/ is not a package)."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from helpers import REPO, load_bench
from holmes_jax import cli


@pytest.mark.parametrize("status, signal_name", [(130, "SIGINT"), (143, "SIGTERM")])
def test_schedules_stopped_during_a_launch_exits_with_the_signal_status(monkeypatch, capsys, status, signal_name):
    """Ctrl-C during a launch came back from `launch` as status 130, and the bench reported it as
    'holmes_jax.profile failed with status 130', exit status 1: a stop, not a failure."""
    bench = load_bench("schedules")
    monkeypatch.setattr(bench.launch, "launch", lambda *args, **kwargs: status)
    with pytest.raises(SystemExit) as stop:
        cli.run(lambda argv: bench.run(["holmes_jax.profile"]), [])
    assert stop.value.code == status
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"schedules: stopped by {signal_name}"]


def test_schedules_a_failed_launch_is_still_a_failure(monkeypatch):
    bench = load_bench("schedules")
    monkeypatch.setattr(bench.launch, "launch", lambda *args, **kwargs: 1)
    with pytest.raises(SystemExit) as stop:
        bench.run(["holmes_jax.train"])
    assert stop.value.code == "schedules: holmes_jax.train failed with status 1"


def test_schedules_pins_the_stages_to_cores_this_process_may_use(monkeypatch):
    """The stages were pinned to cores 0 and 1, which taskset refuses in a container whose cpuset
    holds other cores: the bench failed with 'holmes_jax.profile failed with status 1'."""
    bench = load_bench("schedules")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {7, 4, 9})
    launched = []
    monkeypatch.setattr(bench.launch, "launch", lambda cmd, n, wrap, **kwargs: launched.append(
        [wrap(rank) for rank in range(n)]) or 0)
    bench.run(["holmes_jax.profile"])
    assert launched == [[["taskset", "-c", "4"], ["taskset", "-c", "7"]]]


def test_schedules_with_one_core_says_it_needs_two(monkeypatch, capsys):
    bench = load_bench("schedules")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    monkeypatch.setattr(bench.launch, "launch", lambda *args, **kwargs: pytest.fail("launched with one core"))
    with pytest.raises(SystemExit) as stop:
        cli.run(lambda argv: bench.run(["holmes_jax.profile"]), [])
    assert stop.value.code == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: schedules needs 2 cores, one a stage; this process may use only core 3"]


def test_pipeline_microbatch_counts_keeps_each_count_once():
    """`--microbatches 4,4` built, timed and printed every configuration of m = 4 twice."""
    assert load_bench("pipeline").microbatch_counts("8,4,8,4") == [8, 4]


def run_hetero_nic(*flags: str) -> subprocess.CompletedProcess:
    """bench/hetero_nic.py as a user runs it (never without a flag here: as root that is the 40-minute bench)."""
    assert flags
    return subprocess.run([sys.executable, str(REPO / "bench" / "hetero_nic.py"), *flags], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def test_hetero_nic_an_unknown_flag_is_one_line_that_lists_the_flags():
    """argparse printed its usage and named only the bad flag."""
    done = run_hetero_nic("--sise")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: unrecognized arguments: --sise; allowed: --help, --size"]
    assert done.stdout == ""


def test_hetero_nic_help_prints_the_whole_description():
    """--help printed a one-sentence summary: not the configurations, the run's length or --size's use."""
    done = run_hetero_nic("--help")
    assert done.returncode == 0
    out = " ".join(done.stdout.split())
    assert "(g) as (f), auto partition from a profile measured on that testbed" in out
    assert "Sizing (no root): python bench/hetero_nic.py --size" in out


class FakeCluster:
    """An emulated cluster whose every launch ends with `status`, as `launch` reports it."""

    def __init__(self, status: int):
        self.status = status

    def run(self, cmd, **kwargs) -> int:
        return self.status


def test_hetero_nic_pins_each_rank_to_a_core_this_process_may_use(tmp_path):
    """Rank r was pinned to core r, which taskset refuses in a container whose cpuset holds
    other cores: the launch failed, an hour's testbed run in."""
    bench = load_bench("hetero_nic")
    usable = sorted(os.sched_getaffinity(0))
    cores = tuple(usable[(r + 1) % len(usable)] for r in range(4))  # not rank r on core r

    (tmp_path / "affinity.py").write_text("import os\nprint(sorted(os.sched_getaffinity(0)))\n")

    class RunsEachRank:
        def run(self, cmd, **kwargs):  # as the cluster would, rank by rank: each prints its cores
            for rank in range(4):
                with open(tmp_path / f"rank{rank}", "w") as out:
                    subprocess.run(cmd, env={**os.environ, "HOLMES_PROCESS_ID": str(rank), "PYTHONPATH": str(tmp_path)},
                                   check=True, stdout=out)
            return 0

    assert bench.run(bench.Testbed(RunsEachRank(), cores=cores), ["affinity"]) == 0
    assert [(tmp_path / f"rank{r}").read_text().strip() for r in range(4)] == [f"[{c}]" for c in cores]


@pytest.mark.parametrize("status, signal_name", [(130, "SIGINT"), (143, "SIGTERM"), (129, "SIGHUP")])
def test_hetero_nic_stopped_during_a_configuration_exits_with_the_signal_status(tmp_path, capsys, status, signal_name):
    """Ctrl-C during a configuration's launch came back as status 130, and the bench reported
    'run (c) failed with status 130' and went on to exit 1: a stop, not a failure."""
    bench = load_bench("hetero_nic")

    def configuration(bed):
        return bench.train(bed, "c", tmp_path / "run-c", tmp_path / "hetero.toml", "holmes", "uniform",
                           tmp_path / "profile.json")

    with pytest.raises(SystemExit) as stop:
        cli.run(lambda argv: configuration(bench.Testbed(FakeCluster(status), cores=())), [])
    assert stop.value.code == status
    assert capsys.readouterr().err.strip().splitlines() == [f"hetero_nic: stopped by {signal_name}"]
    # a launch that failed on its own is still a failure: no figures, and the line says so
    assert configuration(bench.Testbed(FakeCluster(1), cores=())) is None
    assert capsys.readouterr().err.strip().splitlines() == ["hetero_nic: run (c) failed with status 1"]


SCRIPTS = ("overhead", "planner_scale", "paper_scenarios", "pipeline", "gpu", "schedules", "checkpoint_memory")


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_bench_help_prints_its_whole_docstring(capsys, name):
    """planner_scale and paper_scenarios printed their docstring's first line only: not what they
    measure, their targets or their JSON line; schedules its first line, which ends mid-sentence."""
    bench = load_bench(name)
    with pytest.raises(SystemExit) as stop:
        bench.main(["--help"])
    assert stop.value.code == 0
    assert " ".join(bench.__doc__.split()) in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("name", ["overhead", "pipeline"])
def test_a_cpu_bench_runs_on_cpu_devices_on_a_gpu_host_too(name):
    # on a GPU host JAX picked the GPU: one device where the bench builds a mesh of 8
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    r = subprocess.run([sys.executable, "-c", f"import jax, helpers; helpers.load_bench({name!r}); "
                        "print(jax.config.jax_platforms)"], capture_output=True, text=True, timeout=120,
                       cwd=REPO / "tests", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cpu"]


def fake_plan(*args, **kwargs):
    """A plan as planner_scale reads it, without planning."""
    return SimpleNamespace(mesh={"stage": 1, "data": 8, "tensor": 1}, microbatches=1, schedule="gpipe",
                           prediction=SimpleNamespace(tflops_per_device=1.0))


def run_planner_scale(bench, monkeypatch) -> None:
    monkeypatch.setattr(bench, "plan", fake_plan)
    bench.main([])


def run_pipeline(bench, monkeypatch) -> None:
    """Every configuration built, timed and measured by fakes: the table and JSON line only."""
    monkeypatch.setattr(bench, "data", SimpleNamespace(load=lambda cfg: None))
    monkeypatch.setattr(bench, "prepare", lambda *args: {})
    monkeypatch.setattr(bench, "time_steps", lambda run, steps: 1.0)
    for name in ("stage_work_ratio", "stage_flops_ratio", "temp_bytes_fixed_microbatch"):
        monkeypatch.setattr(bench, name, lambda *args: 1)
    bench.main(["--microbatches", "4", "--rounds", "1"])


def run_overhead(bench, monkeypatch) -> None:
    """A real run of a one-layer model, one step a round (a few seconds)."""
    bench.main(["--steps", "1", "--rounds", "1", "--gin.ModelConfig.num_layers=1", "--gin.ModelConfig.hidden=32",
                "--gin.ModelConfig.num_heads=2", "--gin.ModelConfig.ffn_hidden=64", "--gin.DataConfig.seq_len=16",
                "--gin.DataConfig.global_batch=8"])


def run_paper_scenarios(bench, monkeypatch) -> None:
    bench.main([])  # the cost model only: a few seconds


def run_checkpoint_memory(bench, monkeypatch) -> None:
    """One layout, really compiled (a few seconds)."""
    monkeypatch.setattr(bench, "LAYOUTS", [(2, 4, 1, [6, 2])])
    bench.main([])


def run_schedules(bench, monkeypatch) -> None:
    """No launch: the profile, both schedules' runs and the predictions are fakes."""
    monkeypatch.setattr(bench, "run", lambda module_args: None)
    monkeypatch.setattr(bench, "step_s", lambda workdir, schedule, m: 1.0)
    monkeypatch.setattr(bench, "predicted_s", lambda profile, schedule, m: 1.0)
    bench.main(["--rounds", "1"])


@pytest.mark.parametrize("name, run", [("planner_scale", run_planner_scale), ("pipeline", run_pipeline),
                                       ("overhead", run_overhead), ("paper_scenarios", run_paper_scenarios),
                                       ("schedules", run_schedules), ("checkpoint_memory", run_checkpoint_memory)])
def test_a_bench_docstring_names_every_key_of_its_json_line(monkeypatch, capsys, name, run):
    """Their docstrings (and so --help) did not say that the last line is JSON, nor what its keys are."""
    bench = load_bench(name)
    run(bench, monkeypatch)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    keys = set(result) | {key for row in result.get("rows", []) for key in row}  # pipeline's rows too
    undocumented = sorted(key for key in keys if f"`{key}`" not in bench.__doc__)
    assert keys and not undocumented
    assert "Last line: one JSON object" in bench.__doc__
