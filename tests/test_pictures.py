"""`python -m holmes_jax.plan --draw`: the timeline drawn is the cost model's step, and the
pictures are written (or refused with one error line)."""

import contextlib
import dataclasses
import functools
import io
import math

import matplotlib.image
import pytest
from matplotlib.text import Text

from holmes_jax import cli, pictures
from holmes_jax.config import ConfigError, ModelConfig, ParallelConfig
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


def _planned(name):
    """The plan PLANS[name] names, and its timeline."""
    topology, model, parallel = PLANS[name]
    p = plan(str(topology), model, parallel, global_batch=64, allow_mixed=True)
    return p, pictures.timeline(p)


@pytest.mark.parametrize("name", PLANS)
def test_the_timeline_ends_where_the_cost_model_says(name):
    p, segments = _planned(name)
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


@pytest.mark.parametrize("microbatches, said", [(1, "gpipe, 1 microbatch of 8,"), (2, "gpipe, 2 microbatches of 4,")])
def test_the_timelines_title_counts_its_microbatches(tmp_path, monkeypatch, microbatches, said):
    figures = []
    monkeypatch.setattr(pictures.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    parallel = ParallelConfig(tp=4, pp=1, microbatches=microbatches, schedule="gpipe")
    p = plan(str(TOPOLOGIES / "cpu_2x4.toml"), "tiny", parallel, global_batch=16, allow_mixed=True)
    pictures.draw_plan(p, str(tmp_path / "plan.png"))
    assert said in figures[0].axes[0].get_title(loc="left")


def test_a_report_of_one_row_marks_whole_steps_only(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(pictures.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    pictures.draw_report([{"step": 1, "loss": 5.3, "step_time_s": 0.7}], 0.1, str(tmp_path / "r.png"))
    for ax in figures[0].axes:
        low, high = ax.get_xlim()
        shown = [t for t in ax.get_xticks() if low <= t <= high]
        assert shown == [1], shown  # not 0.96, 0.98, ... around the only step


@pytest.mark.parametrize("name", PLANS)
def test_the_timeline_draws_only_real_sync_as_sync(name):
    # a stage that waits for the slowest stage's reduction is idle, not syncing for that long
    p, segments = _planned(name)
    pr = p.prediction
    for s in range(p.pp):
        drawn = sum(g.seconds for g in segments if g.stage == s and g.kind == "sync")
        assert drawn == pytest.approx(pr.stage_sync_s[s] + pr.shared_sum_s, rel=1e-9)


def test_an_uneven_plans_idle_stage_waits_uncoloured():
    p = plan(str(TOPOLOGIES / "ib4_roce4.toml"), "1.3b", ParallelConfig(tp=8, pp=2, stage_layers=(23, 1)),
             global_batch=32)  # 64 rows in one microbatch: over memory
    pr = p.prediction
    ended = [g for g in pictures.timeline(p) if g.stage == 1 and g.start >= pr.stage_busy_s[1]]
    assert sum(g.seconds for g in ended) < pr.stage_finish_s[1] - pr.stage_busy_s[1] - 0.05  # the wait for stage 0


def _texts_overlapping(fig):
    """Pairs of the figure's visible texts whose boxes overlap, as drawn."""
    fig.canvas.draw()  # lays the legends out
    renderer = fig.canvas.get_renderer()
    hidden = {id(t) for ax in fig.axes if not ax.axison for t in ax.get_xticklabels() + ax.get_yticklabels()}
    boxes = [(t.get_text(), t.get_window_extent(renderer).padded(-0.5)) for t in fig.findobj(Text)
             if t.get_visible() and t.get_text().strip() and id(t) not in hidden]
    return [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1:] if box.overlaps(other)]


def _topology(tmp_path, clusters, devices_per_node=2, name="c{i}"):
    nics = ("infiniband", "roce", "ethernet")
    text = "".join(f'[[cluster]]\nname = "{name.format(i=i)}"\nnic = "{nics[i % 3]}"\nnodes = 1\n'
                   f"devices_per_node = {devices_per_node}\n\n" for i in range(clusters))
    path = tmp_path / "topology.toml"
    path.write_text(text + '[inter_cluster]\nnic = "ethernet"\ngbps = 25\n')
    return str(path)


@pytest.mark.parametrize("clusters, devices_per_node, name", [
    (12, 2, "c{i}"),  # many clusters
    (4, 1, "datacenter-{i}-a-rather-long-cluster-name-rack-{i}"),  # names longer than their clusters
])
def test_a_plan_picture_has_no_labels_on_top_of_each_other(tmp_path, monkeypatch, clusters, devices_per_node, name):
    figures = []
    monkeypatch.setattr(pictures.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    p = plan(_topology(tmp_path, clusters, devices_per_node, name), "125m",
             ParallelConfig(pp=clusters, microbatches=clusters), global_batch=clusters * devices_per_node)
    pictures.draw_plan(p, str(tmp_path / "plan.png"))
    assert _texts_overlapping(figures[0]) == []


def test_a_report_marks_the_steps_whose_loss_was_not_finite(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(pictures.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    rows = [{"step": s, "loss": math.nan, "step_time_s": 0.5} for s in (10, 20, 30)]
    pictures.draw_report(rows, None, str(tmp_path / "r.png"))
    loss_ax = figures[0].axes[0]
    low, high = loss_ax.get_xlim()
    assert low < 10 and high > 30  # the loss axis spans the run's steps, not 0 alone
    marked = [line for line in loss_ax.get_lines() if "not finite" in line.get_label()]
    assert len(marked) == 1 and list(marked[0].get_xdata()) == [10, 20, 30]


def test_a_report_marks_the_validations_whose_loss_was_not_finite(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(pictures.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    rows = [{"step": s, "loss": 3.0, "step_time_s": 0.5, "val_loss": v}
            for s, v in ((10, 3.1), (20, math.nan), (30, math.inf))]
    pictures.draw_report(rows, None, str(tmp_path / "r.png"))
    marked = [line for line in figures[0].axes[0].get_lines() if line.get_label().startswith("validation loss not")]
    assert len(marked) == 1 and list(marked[0].get_xdata()) == [20, 30]


@pytest.mark.parametrize("target", ["no-such-dir/x.png", "folder.png"])
def test_a_picture_that_cannot_be_written_is_one_error(tmp_path, target):
    (tmp_path / "folder.png").mkdir()
    p = plan(str(TOPOLOGIES / "cpu_2x4.toml"), "tiny", ParallelConfig(pp=2, microbatches=2), global_batch=8)
    with pytest.raises(ConfigError, match="cannot be written"):
        pictures.draw_plan(p, str(tmp_path / target))
    with pytest.raises(ConfigError, match="cannot be written"):
        pictures.draw_report([{"step": 1, "loss": 5.3, "step_time_s": 0.7}], None, str(tmp_path / target))


def test_names_are_drawn_as_typed_not_as_mathtext(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(pictures.Figure, "savefig", lambda fig, *a, **k: (fig.canvas.draw(), figures.append(fig)))
    name = "rack$\\\\{i}$"  # TOML's escape: the clusters are named rack$\0$ and rack$\1$
    p = plan(_topology(tmp_path, 2, 1, name), "tiny", ParallelConfig(pp=2), global_batch=2)
    pictures.draw_plan(p, str(tmp_path / "plan.png"))  # was: a mathtext ParseException
    pictures.draw_report([{"step": 1, "loss": 5.3, "step_time_s": 0.7}], None, str(tmp_path / "r.png"),
                         title="runs/$x$")
    texts = [t.get_text() for fig in figures for t in fig.findobj(Text)]
    assert any(t.startswith("rack$\\0$: infiniband") for t in texts) and "runs/$x$" in texts


def test_a_reports_step_time_is_drawn_in_the_unit_its_median_is_printed_in(tmp_path, monkeypatch):
    # The warm-up row (5 s) lifted the median of all rows over a second: the axis and labels said
    # '0.96 s' where `report` printed 'step time 960 ms (median), predicted 900 ms'.
    figures = []
    monkeypatch.setattr(pictures.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    rows = [{"step": s, "loss": 3.0, "step_time_s": t} for s, t in ((1, 5.0), (2, 0.95), (3, 1.2), (4, 0.96))]
    pictures.draw_report(rows, 0.9, str(tmp_path / "r.png"))
    time_ax = figures[0].axes[1]
    assert time_ax.get_ylabel() == "step time (ms)"
    labels = [line.get_label() for line in time_ax.get_lines()]
    assert "measured median 960 ms" in labels and any(label.startswith("plan's prediction 900 ms") for label in labels)


def test_microbatch_numbers_fit_inside_their_boxes(tmp_path, monkeypatch):
    # a number drawn in a box as wide as its glyph ran into its neighbours': '0 1 2 3 4 5 6 7 8 9'
    # read as one string along the last stage of a GPipe step on eth8
    figures = []
    monkeypatch.setattr(pictures.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    crowded = plan(str(TOPOLOGIES / "eth8.toml"), ModelConfig(preset="7.5b", remat="full"),
                   ParallelConfig(tp=8, pp=4, microbatches=32, schedule="gpipe"), global_batch=64)
    plans = [crowded, _planned("ib4_roce4 7.5b 1f1b")[0]]
    drawn = 0
    for p in plans:
        pictures.draw_plan(p, str(tmp_path / "plan.png"))
        fig = figures[-1]
        ax = fig.axes[0]
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = {(p.pp - 1 - g.stage, g.start + g.seconds / 2): g for g in pictures.timeline(p) if g.microbatch >= 0}
        for t in (t for t in ax.texts if t.get_text().isdigit()):
            g = boxes[t.get_position()[1], t.get_position()[0]]
            assert t.get_text() == str(g.microbatch)
            left, right = ax.transData.transform([(g.start, 0), (g.start + g.seconds, 0)])[:, 0]
            box = t.get_window_extent(renderer)
            assert left + 1 < box.x0 and box.x1 < right - 1, (t.get_text(), left, right, box)
            drawn += 1
    assert drawn  # the 1f1b plan's boxes hold their numbers


def test_one_clusters_placement_names_no_link_between_clusters(tmp_path, monkeypatch):
    # eth8 has one cluster and no [inter_cluster]: the note named the default link's 25 Gb/s anyway
    figures = []
    monkeypatch.setattr(pictures.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    for topology in ("eth8.toml", "ib4_roce4.toml"):
        p = plan(str(TOPOLOGIES / topology), "125m", ParallelConfig(tp=4, pp=2), global_batch=64)
        pictures.draw_plan(p, str(tmp_path / "plan.png"))
    texts = [[t.get_text() for t in fig.axes[1].texts] for fig in figures]
    assert not any("between clusters" in t for t in texts[0])
    assert any("between clusters: ethernet at 25 Gb/s per node" in t for t in texts[1])


@pytest.mark.parametrize("remat, said", [("none", "(12 layers, float32) on"),
                                         ("full", "(12 layers, float32, remat full) on")])
def test_the_timelines_title_says_what_the_backward_recomputes(tmp_path, monkeypatch, remat, said):
    # a rematerialised backward is longer: the title says so, as the plan's printout does
    figures = []
    monkeypatch.setattr(pictures.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    p = plan(str(TOPOLOGIES / "ib8.toml"), ModelConfig(preset="125m", remat=remat), ParallelConfig(tp=4, pp=2),
             global_batch=64)
    pictures.draw_plan(p, str(tmp_path / "plan.png"))
    assert said in figures[0].axes[0].get_title(loc="left")


def test_a_report_marks_where_the_run_resumed(tmp_path, monkeypatch):
    # the resumed run's first row (step 31: its first step pays for warm-up) stood out as an
    # unexplained spike in the step time
    figures = []
    monkeypatch.setattr(pictures.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    rows = [{"step": s, "loss": 3.0, "step_time_s": 0.5} for s in (10, 20, 30)]
    rows += [{"step": 31, "loss": 3.0, "step_time_s": 0.9, "resumed_from": 30},
             {"step": 40, "loss": 2.9, "step_time_s": 0.5}, {"step": 50, "loss": 2.9, "step_time_s": 0.5}]
    rows[0]["step_time_s"] = 2.0  # the run before the resume's own layout: its times are not the plan's
    pictures.draw_report(rows, 0.4, str(tmp_path / "r.png"))
    pictures.draw_report(rows[:3], 0.4, str(tmp_path / "r.png"))
    for ax in figures[0].axes:
        marked = [line for line in ax.get_lines() if line.get_label() == "resumed from step 30's checkpoint"]
        assert len(marked) == 1 and list(marked[0].get_xdata()) == [30.5, 30.5]
    assert not [line for ax in figures[1].axes for line in ax.get_lines() if "resumed" in line.get_label()]
    # plan.json is the resumed run's own: its prediction, and the median it is compared with, say so
    labels = [line.get_label() for line in figures[0].axes[1].get_lines()]
    assert "measured median 500 ms, the run from step 31's" in labels, labels
    assert "plan's prediction 400 ms, the run from step 31's (measured / predicted = 1.25)" in labels, labels
    labels = [line.get_label() for line in figures[1].axes[1].get_lines()]
    assert "measured median 500 ms" in labels and "plan's prediction 400 ms (measured / predicted = 1.25)" in labels


@pytest.mark.parametrize("step_s, said", [(0.9996, "pipeline ends 1 s, step 1 s"),
                                          (1234.5, "pipeline ends 1230 s, step 1230 s")])
def test_the_timelines_times_read_as_the_plans_printout(tmp_path, monkeypatch, step_s, said):
    # the picture had its own copy of the formatting, without the rounding before the unit:
    # 0.9996 s read "1e+03 ms" and 1234.5 s "1.23e+03 s" where explain() says "1 s" and "1230 s"
    figures = []
    monkeypatch.setattr(pictures.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    p, _ = _planned("cpu_2x4 one stage")
    p = dataclasses.replace(p, prediction=dataclasses.replace(p.prediction, step_time_s=step_s, pipeline_s=step_s))
    pictures.draw_plan(p, str(tmp_path / "plan.png"))
    texts = [t.get_text() for t in figures[0].axes[0].texts]
    assert said in texts, texts
    assert f"predicted step {said.rpartition(' step ')[2]} |" in p.explain()
