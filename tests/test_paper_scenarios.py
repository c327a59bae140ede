"""bench/paper_scenarios.py: runs, ends with its JSON line, and meets the targets it can."""

import json
import subprocess
import sys

import pytest

from helpers import REPO

KEYS = ("ib_tflops", "roce_tflops", "eth_tflops", "holmes_mixed_tflops", "naive_mixed_tflops")


@pytest.fixture(scope="module")
def figures():
    r = subprocess.run([sys.executable, "bench/paper_scenarios.py"], capture_output=True, text=True, cwd=REPO,
                       env={"PYTHONPATH": str(REPO), "PATH": ""}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_json_line_has_every_scenario_and_the_papers_figures(figures):
    assert set(KEYS) <= set(figures) and set(figures["paper"]) == set(KEYS)
    assert figures["paper"]["ib_tflops"] == 197.0 and figures["paper"]["holmes_mixed_tflops"] == 195.0
    assert all(figures[k] > 0 for k in KEYS)


def test_targets_met_but_the_one_reported_miss(figures):
    paper = figures["paper"]
    for key in ("ib_tflops", "roce_tflops", "eth_tflops", "naive_mixed_tflops"):
        assert abs(figures[key] / paper[key] - 1) <= 0.20, key
    for key in ("roce_tflops", "eth_tflops"):
        assert abs(figures[key] / figures["ib_tflops"] - paper[key] / paper["ib_tflops"]) <= 0.07, key
    assert figures["holmes_mixed_tflops"] > figures["naive_mixed_tflops"]
    # Holmes on the mixed cluster is predicted below the paper's figure by more than 20%
    # (docs/nccl.md says why); the bench reports exactly that and nothing else.
    holmes_off = abs(figures["holmes_mixed_tflops"] / paper["holmes_mixed_tflops"] - 1)
    assert [m.split()[0] for m in figures["missed"]] == ([] if holmes_off <= 0.20 else ["holmes_mixed_tflops"])
