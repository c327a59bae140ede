"""`python -m holmes_jax.plan --draw`: the timeline drawn is the cost model's step, and the
pictures are written (or refused with one error line)."""

import contextlib
import functools
import io

import matplotlib.image
import pytest

from holmes_jax import cli, pictures
from holmes_jax.config import ConfigError, ParallelConfig
from holmes_jax.planning import cli as planning_cli
from holmes_jax.planning import plan
from helpers import REPO, run_module

TOPOLOGIES = REPO / "configs" / "topologies"
PLANS = {
    "ib4_roce4 7.5b 1f1b": (TOPOLOGIES / "ib4_roce4.toml", "7.5b", ParallelConfig(tp=8, pp=2, microbatches=16,
                                                                                   schedule="1f1b")),
    "three_clusters gpipe": (TOPOLOGIES / "three_clusters.toml", "1.3b", ParallelConfig(tp=2, pp=4, microbatches=8)),
    "cpu_2x4 one stage": (TOPOLOGIES / "cpu_2x4.toml", "tiny", ParallelConfig(pp=1, microbatches=4)),
}


@pytest.mark.parametrize("name", PLANS)
def test_the_timeline_ends_where_the_cost_model_says(name):
    topology, model, parallel = PLANS[name]
    p = plan(str(topology), model, parallel, global_batch=64, allow_mixed=True)
    segments = pictures.timeline(p)
    pr = p.prediction
    pipeline_end = max(g.start + g.seconds for g in segments if g.kind in ("forward", "backward", "transfer"))
    assert pipeline_end == pytest.approx(pr.pipeline_s, rel=1e-12)
    for s in range(p.pp):
        mine = [g for g in segments if g.stage == s]
        assert max(g.start + g.seconds for g in mine) == pytest.approx(pr.stage_finish_s[s], rel=1e-12)
        forwards = sorted(g.microbatch for g in mine if g.kind == "forward")
        assert forwards == ([] if s == p.pp - 1 else list(range(p.microbatches)))  # the last stage's forward runs in its backward's tick
        assert sorted(g.microbatch for g in mine if g.kind == "backward") == list(range(p.microbatches))
        busy = sorted((g.start, g.start + g.seconds) for g in mine)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(busy, busy[1:]))  # a stage does one thing at a time


def _run(main, *args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        cli.run(main, list(args))
    return e.value.code, out.getvalue(), err.getvalue()


def test_plan_draw_writes_a_picture(tmp_path):
    path = tmp_path / "plan.png"
    r = run_module("holmes_jax.plan", "--topology", str(TOPOLOGIES / "cpu_2x4.toml"), "--model", "tiny",
                   "--pp", "2", "--microbatches", "4", "--draw", str(path))
    assert r.returncode == 0 and "predicted step" in r.stdout, r.stderr
    height, width, _ = matplotlib.image.imread(path).shape
    assert width > 1000 and height > 400


@pytest.mark.parametrize("target, message", [("pic.jpg", "--draw"), ("no/such/folder/pic.png", "existing folder")])
def test_plan_draw_refuses_a_bad_file_name(tmp_path, target, message):
    draw = functools.partial(planning_cli.main, draw=pictures.draw_plan)  # what holmes_jax.plan runs
    code, _, err = _run(draw, "--topology", str(TOPOLOGIES / "cpu_2x4.toml"), "--model", "tiny",
                        "--draw", str(tmp_path / target))
    assert code == 2 and err.startswith("error:") and message in err and len(err.splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_draw_needs_the_callback():
    with pytest.raises(ConfigError, match="--draw"):
        planning_cli.main(["--topology", str(TOPOLOGIES / "cpu_2x4.toml"), "--model", "tiny", "--draw", "x.png"])


def test_a_report_of_one_row_marks_whole_steps_only(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(pictures.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    pictures.draw_report([{"step": 1, "loss": 5.3, "step_time_s": 0.7}], 0.1, str(tmp_path / "r.png"))
    for ax in figures[0].axes:
        low, high = ax.get_xlim()
        shown = [t for t in ax.get_xticks() if low <= t <= high]
        assert shown == [1], shown  # not 0.96, 0.98, ... around the only step
