"""bench/paper_scenarios.py: runs, ends with its JSON line, evaluates the paper's layouts (not
searched ones) and reports exactly the targets it misses."""

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


def test_the_bench_reports_exactly_the_targets_it_misses(figures):
    """The issue's targets, checked here from the figures themselves: the bench's `missed` list
    names each target missed and no other (some are missed today: see the README)."""
    paper = figures["paper"]
    expected = {key for key in paper if abs(figures[key] / paper[key] - 1) > 0.20}
    expected |= {f"{key}/ib" for key in ("roce", "eth")
                 if abs(figures[f"{key}_tflops"] / figures["ib_tflops"]
                        - paper[f"{key}_tflops"] / paper["ib_tflops"]) > 0.07}
    if figures["holmes_mixed_tflops"] <= figures["naive_mixed_tflops"]:
        expected.add("Holmes")
    assert {m.split()[0] for m in figures["missed"]} == expected
    assert len(figures["missed"]) == len(expected)


def test_the_targets_are_the_papers_layouts_not_the_planners(figures):
    """The 3.6B runs keep the reference script's sizes (tensor 1, pipeline 1, micro batch 4, global
    batch 512) on every fabric; the mixed runs share one layout and differ only in placement."""
    layouts = figures["layouts"]
    for key in ("ib", "roce", "eth"):
        lay = layouts[key]
        assert lay["mesh"] == {"stage": 1, "data": 32, "tensor": 1}
        assert (lay["micro_batch"], lay["microbatches"]) == (4, 4)
        assert figures[f"{key}_tflops"] == lay["tflops"]
    holmes, naive = layouts["holmes_mixed"], layouts["naive_mixed"]
    assert holmes["mesh"] == naive["mesh"] == {"stage": 2, "data": 16, "tensor": 2}
    assert holmes["micro_batch"] == naive["micro_batch"] == 4
    assert holmes["microbatches"] * holmes["micro_batch"] * holmes["mesh"]["data"] == 512
    assert sum(holmes["stage_layers"]) == sum(naive["stage_layers"]) == 36


def test_the_planner_does_no_worse_than_the_papers_layout(figures):
    """The planner's search includes each paper layout, so its pick is predicted at least as fast."""
    for key, lay in figures["layouts"].items():
        assert figures["planner"][key]["tflops"] >= lay["tflops"], key
