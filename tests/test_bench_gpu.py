import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from helpers import REPO, load_bench, small_configs
from holmes_jax.mesh.devices import ordered_devices


@pytest.mark.slow
def test_gpu_bench_runs_its_cpu_setting_and_ends_with_its_figures():
    out = subprocess.run([sys.executable, "bench/gpu.py", "--cpu-setting", "--steps", "1", "--rounds", "1"],
                         capture_output=True, text=True, timeout=600, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("no GPU measured")
    result = json.loads(lines[-1])
    assert {"device_kind", "model", "mfu", "tflops_per_device", "minimal_ratio", "gpu_measured"} <= set(result)
    assert result["gpu_measured"] is False and result["model"] == "tiny" and result["device_kind"] == "cpu"
    assert result["tflops_per_device"] > 0 and result["minimal_ratio"] > 0
    assert result["mfu"] is None  # a CPU has no known bf16 peak
    run = result["runs"][0]
    assert run["devices"] == 8 and run["step_s"] > 0 and run["tokens_per_s"] == pytest.approx(
        run["global_batch"] * run["seq_len"] / run["step_s"])



def _minimal_steps(tmp_path, name: str, steps: int):
    """Runs `steps` of bench/<name>.py's minimal step; returns it and the state each call took."""
    cfgs = small_configs(tmp_path, "--gin.ParallelConfig.dp=8")
    step, params, opt_state, batch_sharding = load_bench(name).minimal_step(cfgs, ordered_devices())
    d = cfgs.data
    tokens = np.random.default_rng(0).integers(0, cfgs.model.vocab_size, (d.global_batch, d.seq_len + 1), np.int32)
    batch = jax.device_put(tokens, batch_sharding)
    taken = []
    for _ in range(steps):
        taken.append(jax.tree.leaves((params, opt_state)))
        params, opt_state, loss = step(params, opt_state, batch)
    jax.block_until_ready(loss)
    return step, taken


@pytest.mark.parametrize("name", ["gpu", "overhead"])
def test_the_minimal_step_compiles_once_so_the_warm_up_covers_it(tmp_path, name):
    """The warm-up is one round: a step that compiled again on its second call (the optimizer
    state's step count came back with another sharding) timed that compilation with --steps 1."""
    step, _ = _minimal_steps(tmp_path, name, 3)
    assert step._cache_size() == 1


@pytest.mark.parametrize("name", ["gpu", "overhead"])
def test_the_minimal_step_updates_in_place_as_the_holmes_step_does(tmp_path, name):
    """The holmes_jax step donates its state; the minimal one must too, or the two differ in
    memory traffic and footprint, not only in the framework's work."""
    _, taken = _minimal_steps(tmp_path, name, 2)
    assert all(x.is_deleted() for x in taken[0] + taken[1])


@pytest.mark.parametrize("script, args, names", [
    ("gpu.py", ["--cpu-setting", "--steps", "0"], "--steps"),
    ("overhead.py", ["--rounds", "0"], "--rounds"),
    ("overhead.py", ["--gin.Nope.x=1"], "Nope"),
    # a pipeline against the data-parallel minimal step priced the pipeline as framework overhead
    ("overhead.py", ["--steps", "1", "--rounds", "1", "--gin.ParallelConfig.pp=2", "--gin.ParallelConfig.dp=4"],
     "pp = 2"),
    ("overhead.py", ["--steps", "1", "--rounds", "1", "--gin.ParallelConfig.microbatches=2"], "microbatches = 2"),
    ("pipeline.py", ["--microbatches", "6"], "--microbatches"),
    ("schedules.py", ["--microbatches", "0"], "--microbatches"),
    ("paper_scenarios.py", ["--rounds", "1"], "--rounds"),
])
def test_a_bench_rejects_bad_flags_with_one_error_line(script, args, names):
    out = subprocess.run([sys.executable, f"bench/{script}", *args], capture_output=True, text=True, timeout=120,
                         cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], out.stderr[-2000:]


def _fake_run(model, seq_len, batch_per_device, dtype, remat, steps, rounds):
    """What `measure` returns, without measuring."""
    return {"model": model, "params": 1e6, "devices": 8, "device_kind": "NVIDIA H100 80GB HBM3", "dtype": dtype,
            "remat": remat, "seq_len": seq_len, "global_batch": 8 * batch_per_device, "step_s": 0.5,
            "minimal_step_s": 0.5, "tokens_per_s": 1.0, "tflops_per_device": 1.0, "minimal_tflops_per_device": 1.0,
            "mfu": 0.001, "minimal_ratio": 1.0}


def test_gpu_bench_out_of_memory_is_one_error_line(monkeypatch, capsys):
    """A model that does not fit ended the bench with XLA's long traceback; now one line that names
    the model and what to change, exit status 1 (a failure during the run)."""
    from holmes_jax import cli

    bench = load_bench("gpu")

    def out_of_memory(*args):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123 bytes.\nmore")

    monkeypatch.setattr(bench, "measure", out_of_memory)
    with pytest.raises(SystemExit) as stop:
        cli.run(bench.main, ["--cpu-setting"])
    assert stop.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: tiny ") and "--remat" in lines[0], lines
    assert "Out of memory while trying to allocate 123 bytes" in lines[0]


def test_gpu_bench_cpu_setting_on_a_gpu_says_why_no_gpu_was_measured(monkeypatch, capsys):
    """--cpu-setting on a GPU host said 'gpu devices only', which is false there."""
    from holmes_jax import cli

    bench = load_bench("gpu")
    gpu = type("FakeGpu", (), {"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3"})()
    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [gpu] * 8)
    monkeypatch.setattr(bench, "measure", _fake_run)
    with pytest.raises(SystemExit) as stop:
        cli.run(bench.main, ["--cpu-setting"])
    assert stop.value.code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("no GPU measured: --cpu-setting;") and "devices only" not in lines[0], lines[0]
    assert json.loads(lines[-1])["gpu_measured"] is False


def test_overhead_bench_names_its_own_flags_when_one_is_unknown():
    """A mistyped --steps was answered with gin's list of flags, which leaves out --steps and --rounds."""
    out = subprocess.run([sys.executable, "bench/overhead.py", "--setps", "5"], capture_output=True, text=True,
                         timeout=120, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown argument '--setps'"), out.stderr[-2000:]
    assert "--steps" in lines[0] and "--rounds" in lines[0]


def test_gpu_bench_measures_a_repeated_model_once(monkeypatch, capsys):
    """`--models 125m,125m` built and measured 125M twice: minutes of GPU time for a figure it had."""
    from holmes_jax import cli

    bench = load_bench("gpu")
    gpu = type("FakeGpu", (), {"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3"})()
    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [gpu] * 8)
    measured = []
    monkeypatch.setattr(bench, "measure", lambda model, *args: measured.append(model) or _fake_run(model, *args))
    with pytest.raises(SystemExit) as stop:
        cli.run(bench.main, ["--models", "125m,tiny,125m"])
    assert stop.value.code == 0
    assert measured == ["125m", "tiny"]
    assert [run["model"] for run in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"]] == measured
