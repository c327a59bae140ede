import json
import subprocess
import sys

import pytest

from helpers import REPO


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
