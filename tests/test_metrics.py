"""What a run leaves for people to read: TensorBoard scalars equal to metrics.jsonl, the console's
ETA, plan.json, and the report drawn from them."""

import contextlib
import io
import json
import math
import os
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.record_writer import masked_crc32c

from holmes_jax import cli, metrics, report, train
from helpers import REPO, read_metrics, small_configs


def read_events(folder):
    """The Events of every event file under `folder`, in TensorBoard's order (files by name), read
    as TFRecords (length, its CRC, the Event, its CRC) with the writer's own protobuf classes; CRCs
    checked."""
    for path in sorted(Path(folder).glob("events.out.tfevents.*")):
        raw, at = path.read_bytes(), 0
        while at < len(raw):
            header = raw[at:at + 8]
            (length,), (length_crc,) = struct.unpack("<Q", header), struct.unpack("<I", raw[at + 8:at + 12])
            data = raw[at + 12:at + 12 + length]
            (data_crc,) = struct.unpack("<I", raw[at + 12 + length:at + 16 + length])
            assert length_crc == masked_crc32c(header) and data_crc == masked_crc32c(data)
            at += 16 + length
            yield Event.FromString(data)


def read_scalars(folder) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from every event file under `folder` (a later file's value wins)."""
    scalars = {}
    for event in read_events(folder):
        for value in event.summary.value:
            scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def tensorboard_view(folder, tag: str) -> list[tuple[int, float]]:
    """(step, value) of `tag` as TensorBoard's event accumulator keeps them: every SessionLog START
    after the first is a restart and drops the values kept so far from its step on."""
    kept, started = [], False
    for event in read_events(folder):
        if event.session_log.status == SessionLog.START:
            if started:
                kept = [(step, value) for step, value in kept if step < event.step]
            started = True
        kept += [(event.step, value.simple_value) for value in event.summary.value if value.tag == tag]
    return kept


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    train.run(small_configs(workdir, "--gin.TrainConfig.eval_every=3"), quiet=True)
    return workdir


@pytest.mark.slow
def test_tensorboard_holds_every_logged_scalar_of_metrics_jsonl(run_dir):
    rows = read_metrics(run_dir)
    scalars = read_scalars(run_dir / "tensorboard")
    expected = {}
    for row in rows:
        for key, value in row.items():
            if key != "step":
                expected.setdefault(key, {})[row["step"]] = float(np.float32(value))  # events store float32
    assert set(expected) >= {"loss", "val_loss", "grad_norm", "lr", "step_time_s", "tokens_per_s",
                             "tflops_per_device", "mfu"}
    assert scalars == expected


@pytest.mark.slow
def test_the_run_writes_its_plan_for_the_report(run_dir):
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["predicted"]["step_time_s"] > 0 and plan["mesh"]["stage"] == 1


def test_eta_is_the_recent_mean_step_time_times_the_steps_left(tmp_path, capsys):
    log = metrics.MetricsLog(tmp_path / "metrics.jsonl", total_steps=100, stop=10)
    row = {"loss": 1.0, "tokens_per_s": 1.0, "tflops_per_device": 1.0}
    log.write(dict(row, step=1, step_time_s=0.5))  # the first row: one step
    log.write(dict(row, step=4, step_time_s=1.0))  # three steps of 1 s
    log.write(dict(row, step=6, step_time_s=2.5))  # two steps of 2.5 s
    assert log.eta_s(6) == pytest.approx(8 / 5 * 4)
    log.write(dict(row, step=10, step_time_s=1.0))
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("ETA 4s") and lines[1].endswith("ETA 6s") and lines[2].endswith("ETA 6s")
    assert "ETA" not in lines[3]  # the run's last step


@pytest.mark.parametrize("first", [1, 13])  # a fresh run, and one resumed from step 12
def test_the_eta_leaves_out_the_runs_first_step_once_there_are_others(tmp_path, capsys, first):
    # The first step warms up: a resumed run's took 27 steady steps' time, and the ETA after its
    # next rows counted it as if every step took a share of it (10x the steady ETA).
    log = metrics.MetricsLog(tmp_path / "metrics.jsonl", total_steps=30, first=first)
    row = {"loss": 1.0, "tokens_per_s": 1.0, "tflops_per_device": 1.0}
    log.write(dict(row, step=first, step_time_s=0.56))
    assert log.eta_s(first) == pytest.approx(0.56 * (30 - first))  # alone, it is all there is
    log.write(dict(row, step=first + 2, step_time_s=0.02))
    assert log.eta_s(first + 2) == pytest.approx(0.02 * (28 - first))
    log.close()
    assert capsys.readouterr().out.splitlines()[1].endswith(f"ETA {metrics.duration(0.02 * (28 - first))}")


def test_the_step_line_gives_a_fast_steps_milliseconds_to_three_figures(tmp_path, capsys):
    # 2,048 tokens in 0.43 ms: the line must not read '0 ms/step' beside its 4.8 M tok/s
    log = metrics.MetricsLog(tmp_path / "metrics.jsonl", total_steps=2)
    for step, seconds in ((1, 0.172), (2, 0.00043)):
        log.write({"step": step, "loss": 1.0, "step_time_s": seconds, "tokens_per_s": 2048 / seconds,
                   "tflops_per_device": 1.0})
    log.close()
    slow, fast = capsys.readouterr().out.splitlines()
    assert "| 172 ms/step | 11,907 tok/s |" in slow
    assert "| 0.43 ms/step | 4,762,791 tok/s |" in fast


def test_the_runs_last_line_gives_fast_measured_and_predicted_steps_to_three_figures():
    from holmes_jax.train import Rows, summarize

    rows = [{"step": step, "loss": 2.0, "step_time_s": 0.00043, "tokens_per_s": 2048 / 0.00043,
             "tflops_per_device": 1.0} for step in (1, 2, 3)]
    said = []
    summarize(Rows(0, rows), predicted_step_s=0.00286, say=said.append)
    assert "; 0.43 ms/step, 4,762,791 tokens/s, " in said[0] and said[0].endswith("the plan predicted 2.86 ms/step")


def test_durations_read_as_seconds_minutes_hours():
    assert [metrics.duration(s) for s in (4.4, 59.6, 187, 7500)] == ["4s", "1m00s", "3m07s", "2h05m"]


def _report(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        cli.run(report.main, [str(a) for a in args])
    return e.value.code, out.getvalue(), err.getvalue()


@pytest.mark.slow
def test_the_report_draws_the_run_against_its_prediction(run_dir, tmp_path):
    code, out, _ = _report(run_dir, "--out", tmp_path / "r.png")
    assert code == 0
    height, width, _ = matplotlib.image.imread(tmp_path / "r.png").shape
    assert width > 800 and height > 300
    predicted = json.loads((run_dir / "plan.json").read_text())["predicted"]["step_time_s"]
    assert f"predicted {predicted * 1e3:.4g} ms" in out


def test_the_report_keeps_a_resumed_runs_later_rows(tmp_path):
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 2, "loss": 2.4}, {"step": 3, "loss": 2.0}]
    rows = [dict(row, step_time_s=0.1) for row in rows]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["loss"] for r in report.read_rows(tmp_path)] == [3.0, 2.4, 2.0]
    assert report.predicted_step_s(tmp_path) is None


def test_a_skipped_steps_loss_is_null_in_metrics_jsonl_and_drawn_as_not_finite(tmp_path, capsys):
    log = metrics.MetricsLog(tmp_path / "metrics.jsonl", total_steps=3)
    row = {"step_time_s": 0.1, "tokens_per_s": 1.0, "tflops_per_device": 1.0, "mfu": None}
    for step, loss in ((1, 3.0), (2, float("nan")), (3, float("inf"))):
        log.write(dict(row, step=step, loss=loss, val_loss=loss, grad_norm=loss, skipped=step > 1))
    log.close()
    rows = read_metrics(tmp_path)  # NaN and Infinity would raise here
    assert [(r["loss"], r["val_loss"], r["grad_norm"]) for r in rows] == [(3.0, 3.0, 3.0)] + [(None, None, None)] * 2
    assert "loss nan" in capsys.readouterr().out  # the console says what happened
    read = report.read_rows(tmp_path)
    assert read[0]["loss"] == 3.0 and all(math.isnan(r["loss"]) and math.isnan(r["val_loss"]) for r in read[1:])
    code, out, err = _report(tmp_path, "--out", tmp_path / "r.png")
    assert code == 0 and "steps 1-3, loss 3 -> nan" in out, err


@pytest.mark.parametrize("files, message", [
    ({}, "no metrics.jsonl"),
    ({"metrics.jsonl": "{\"loss\": 1}\n"}, "metrics.jsonl:1 is not a metrics row"),
    ({"metrics.jsonl": "{\"step\": 1, \"loss\": 1}\n"}, "metrics.jsonl:1 is not a metrics row"),  # no step_time_s
    ({"metrics.jsonl": b"\xff\xfe\n"}, "metrics.jsonl:1 is not a metrics row"),  # not UTF-8
    ({"metrics.jsonl": "{\"step\": 1, \"loss\": 1, \"step_time_s\": NaN}\n"}, "metrics.jsonl:1 is not a metrics row"),
    # hand edits that were a traceback (a validation loss "x", a resume step "1", brackets nested
    # 200,000 deep), drawn as step 1 (true) or as a negative step time
    *[({"metrics.jsonl": line + "\n"}, "metrics.jsonl:1 is not a metrics row") for line in (
        '{"step": 1, "loss": 1, "step_time_s": 0.1, "val_loss": "x"}',
        '{"step": 1, "loss": 1, "step_time_s": 0.1, "resumed_from": "1"}', "[" * 200_000,
        '{"step": true, "loss": 1, "step_time_s": 0.1}', '{"step": 1, "loss": 1, "step_time_s": -2}')],
    *[({"metrics.jsonl": "{\"step\": 1, \"loss\": 1, \"step_time_s\": 0.1}\n",
        "plan.json": json.dumps({"predicted": {"step_time_s": bad}})}, "plan.json is not a plan")
      for bad in (0, -1.0, float("nan"), float("inf"), "x")],
])
def test_the_report_refuses_what_is_not_a_run(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    code, _, err = _report(tmp_path)
    assert code == 2 and err.startswith("error:") and message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "report.png").exists()


def test_a_plan_json_the_report_cannot_read_is_one_error_line(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "step_time_s": 0.1}) + "\n")
    (tmp_path / "plan.json").write_text(json.dumps({"predicted": {"step_time_s": 0.1}}))
    path_open = Path.open

    def no_permission(path, *args, **kwargs):  # as for another user's file (root reads any)
        if path.name == "plan.json":
            raise PermissionError(13, "Permission denied", str(path))
        return path_open(path, *args, **kwargs)
    monkeypatch.setattr(Path, "open", no_permission)
    code, _, err = _report(tmp_path)
    assert code == 2 and err == f"error: {tmp_path / 'plan.json'} cannot be read: Permission denied\n", err


def test_the_report_names_a_missing_workdir_not_its_default_out(tmp_path):
    code, _, err = _report(tmp_path / "absent")
    assert code == 2 and err.startswith("error: WORKDIR") and "holds no metrics.jsonl" in err, err


def test_the_report_draws_step_times_of_zero_without_a_warning(tmp_path):
    # matplotlib warned "Attempting to set identical low and high ylims" (a clock too coarse, a hand edit)
    rows = [{"step": step, "loss": 3.0, "step_time_s": 0.0} for step in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        code, out, err = _report(tmp_path, "--out", tmp_path / "r.png")
    assert code == 0 and "steps 1-2" in out, err


def test_the_report_gives_steps_of_a_second_and_more_in_seconds(tmp_path):
    rows = [{"step": step, "loss": 3.0, "step_time_s": seconds} for step, seconds in ((1, 12.0), (2, 10.8), (3, 10.9))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "plan.json").write_text(json.dumps({"predicted": {"step_time_s": 10.84}}))
    code, out, err = _report(tmp_path)
    assert code == 0 and "step time 10.85 s (median), predicted 10.84 s" in out, out + err


def test_the_report_of_a_run_that_logged_no_step_yet_says_so(tmp_path):
    # a run writes config.gin and plan.json before it compiles; metrics.jsonl comes with its first row
    (tmp_path / "config.gin").write_text("TrainConfig.steps = 10\n")
    code, _, err = _report(tmp_path)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: WORKDIR") and "the run logged no step yet" in err, err


def test_a_last_row_cut_short_is_skipped_by_the_report_and_dropped_on_resume(tmp_path):
    row = {"loss": 3.0, "step_time_s": 0.1, "tokens_per_s": 1.0, "tflops_per_device": 1.0}
    whole = "".join(json.dumps(dict(row, step=s)) + "\n" for s in (1, 2))
    (tmp_path / "metrics.jsonl").write_text(whole + json.dumps(dict(row, step=3))[:20])  # a crash, a full disk
    assert [r["step"] for r in report.read_rows(tmp_path)] == [1, 2]
    code, out, err = _report(tmp_path, "--out", tmp_path / "r.png")
    assert code == 0 and "steps 1-2" in out, err
    log = metrics.MetricsLog(tmp_path / "metrics.jsonl", total_steps=4, quiet=True, first=3)  # the resumed run
    log.write(dict(row, step=3))
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == whole + json.dumps(dict(row, step=3, resumed_from=2)) + "\n"
    assert [r["step"] for r in report.read_rows(tmp_path)] == [1, 2, 3]


def test_the_report_reads_past_blank_lines_in_a_hand_edited_metrics_jsonl(tmp_path):
    rows = [json.dumps({"step": step, "loss": 3.0, "step_time_s": 0.1}) for step in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text(rows[0] + "\n\n" + rows[1] + "\n \r\n" + rows[2] + "\n\n")
    assert [r["step"] for r in report.read_rows(tmp_path)] == [1, 2, 3]
    code, out, err = _report(tmp_path, "--out", tmp_path / "r.png")
    assert code == 0 and "steps 1-3" in out, err


def test_a_whole_last_row_without_its_newline_stays_on_resume(tmp_path):
    # An editor that saves without a final newline: the report draws that row, and a resumed run
    # must keep it (it dropped it as a row cut short, and the report lost the step for good).
    row = {"loss": 3.0, "step_time_s": 0.1, "tokens_per_s": 1.0, "tflops_per_device": 1.0}
    rows = [json.dumps(dict(row, step=s)) for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text(rows[0] + "\n" + rows[1])
    assert [r["step"] for r in report.read_rows(tmp_path)] == [1, 2]
    log = metrics.MetricsLog(tmp_path / "metrics.jsonl", total_steps=4, quiet=True, first=3)
    log.write(dict(row, step=3))
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert [r["step"] for r in report.read_rows(tmp_path)] == [1, 2, 3]


def test_a_resume_keeps_a_line_nested_too_deep_to_read_as_no_row(tmp_path):
    # the resumed run's reading of the earlier rows raised a RecursionError (a traceback)
    row = {"loss": 3.0, "step_time_s": 0.1, "tokens_per_s": 1.0, "tflops_per_device": 1.0}
    earlier = json.dumps(dict(row, step=1)) + "\n" + "[" * 200_000 + "\n"
    (tmp_path / "metrics.jsonl").write_text(earlier)
    log = metrics.MetricsLog(tmp_path / "metrics.jsonl", total_steps=4, quiet=True, first=2)
    log.write(dict(row, step=2))
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == earlier + json.dumps(dict(row, step=2, resumed_from=1)) + "\n"


def test_each_row_is_in_the_tensorboard_events_once_written(tmp_path):
    # A run killed (SIGKILL, a lost node) after a row must not lose that row's scalars: a resumed
    # run starts after its checkpoint and never logs those steps again.
    log = metrics.MetricsLog(tmp_path / "metrics.jsonl", total_steps=10, quiet=True)
    row = {"loss": 1.0, "step_time_s": 0.1, "tokens_per_s": 1.0, "tflops_per_device": 1.0}
    for step in (1, 2, 3):
        log.write(dict(row, step=step, loss=float(step)))
        assert read_scalars(tmp_path / "tensorboard")["loss"] == {s: float(s) for s in range(1, step + 1)}
    log.close()


def test_tensorboard_shows_a_resumed_runs_steps_once(tmp_path):
    # A run logged steps 1-4 but its newest checkpoint is step 2: the resumed run logs 3 and 4
    # again, and TensorBoard must draw those, not both runs' values at each step.
    row = {"step_time_s": 0.1, "tokens_per_s": 1.0, "tflops_per_device": 1.0}
    first = metrics.MetricsLog(tmp_path / "metrics.jsonl", total_steps=5, quiet=True)
    for step in (1, 2, 3, 4):
        first.write(dict(row, step=step, loss=float(step)))
    first.close()
    resumed = metrics.MetricsLog(tmp_path / "metrics.jsonl", total_steps=5, quiet=True, first=3)
    for step in (3, 4, 5):
        resumed.write(dict(row, step=step, loss=10.0 * step))
    resumed.close()
    assert tensorboard_view(tmp_path / "tensorboard", "loss") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0),
                                                                   (5, 50.0)]


def test_a_run_started_in_the_same_second_keeps_the_earlier_runs_events(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics.time, "time", lambda: 1.7e9)  # tensorboardX names event files by the second
    row = {"step_time_s": 0.1, "tokens_per_s": 1.0, "tflops_per_device": 1.0}
    for steps in ((1, 2), (3, 4)):  # a run stopped after step 2, and its resumed run
        log = metrics.MetricsLog(tmp_path / "metrics.jsonl", total_steps=4, quiet=True, first=steps[0])
        for step in steps:
            log.write(dict(row, step=step, loss=float(step)))
        log.close()
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2
    assert read_scalars(tmp_path / "tensorboard")["loss"] == {s: float(s) for s in (1, 2, 3, 4)}


def test_a_full_disk_under_the_tensorboard_events_is_an_os_error_and_nothing_else(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "tensorboard"  # only the events fill up: metrics.jsonl has room
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    script = ("import contextlib, sys\n"
              "from holmes_jax import metrics\n"
              "log = metrics.MetricsLog(sys.argv[1] + '/metrics.jsonl', total_steps=10**6, quiet=True)\n"
              "row = {'loss': 1.0, 'step_time_s': 0.1, 'tokens_per_s': 1.0, 'tflops_per_device': 1.0}\n"
              "try:\n"
              "    with contextlib.closing(log):\n"  # as the run's loop closes it
              "        for step in range(1, 10**6):\n"
              "            log.write(dict(row, step=step))\n"
              "except OSError as e:\n"
              "    print(e.strerror)\n")
    try:
        r = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120,
                           cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    # The run turns the OSError into one `error:` line; nothing may print beside it.
    assert r.returncode == 0 and r.stdout == "No space left on device\n" and r.stderr == "", r.stderr[-3000:]


@pytest.mark.parametrize("kind, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0),
                                        ("NVIDIA H800 PCIe", 756.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                        ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A800-SXM4-80GB", 312.0),
                                        ("NVIDIA B200", 2250.0), ("NVIDIA GB200", 2500.0), ("NVIDIA L40S", 362.0),
                                        ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0), ("NVIDIA L4X", None),
                                        ("NVIDIA A10", None), ("cpu", None)])
def test_each_device_kind_gets_its_own_dense_bf16_peak(kind, peak):
    assert metrics.device_peak_tflops(kind) == peak


# from its checkpoint at step 2; afresh, without one; from step 2 but logging every other step
@pytest.mark.parametrize("first, resumed_steps", [(3, (3, 4)), (1, (1, 2)), (3, (4,))])
def test_a_resumed_run_replaces_the_earlier_runs_rows_from_its_first_step(tmp_path, first, resumed_steps):
    # The earlier run logged steps 1-5; the resumed run stops after step 4: the earlier run's step 5
    # (lost with it) was drawn in the report after the resumed run's rows, where TensorBoard drops it.
    row = {"step_time_s": 0.1, "tokens_per_s": 1.0, "tflops_per_device": 1.0}
    for start, steps, loss in ((1, (1, 2, 3, 4, 5), 1.0), (first, resumed_steps, 10.0)):
        log = metrics.MetricsLog(tmp_path / "metrics.jsonl", total_steps=6, quiet=True, first=start)
        for step in steps:
            log.write(dict(row, step=step, loss=loss * step))
        log.close()
    kept = [(step, float(step)) for step in range(1, first)]
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == kept + [(s, 10.0 * s) for s in resumed_steps]
    drawn = [(r["step"], r["loss"]) for r in report.read_rows(tmp_path)]
    assert drawn == tensorboard_view(tmp_path / "tensorboard", "loss")
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_the_reports_median_step_time_leaves_out_a_resumed_runs_first_step(tmp_path):
    # A resumed run's first step compiles and warms up as a fresh run's first does: counted as an
    # ordinary step, it pulled the median up.
    row = {"loss": 3.0, "tokens_per_s": 1.0, "tflops_per_device": 1.0}
    for first, times in ((1, {1: 9.0, 2: 0.1}), (3, {3: 9.0, 4: 0.3})):  # stopped after step 2, then resumed
        log = metrics.MetricsLog(tmp_path / "metrics.jsonl", total_steps=4, quiet=True, first=first)
        for step, seconds in times.items():
            log.write(dict(row, step=step, step_time_s=seconds))
        log.close()
    assert [r.get("resumed_from") for r in read_metrics(tmp_path)] == [None, None, 2, None]
    assert "resumed_from" not in read_scalars(tmp_path / "tensorboard")  # a marker, not a number to draw
    code, out, err = _report(tmp_path, "--out", tmp_path / "r.png")
    assert code == 0 and "step time 300 ms (median of the run from step 3)" in out, out + err  # its step 4
    (tmp_path / "plan.json").write_text(json.dumps({"predicted": {"step_time_s": 0.25}}))
    code, out, err = _report(tmp_path, "--out", tmp_path / "r.png")  # plan.json is the resumed run's own
    assert code == 0 and out.rstrip().endswith("predicted 250 ms (by its plan)"), out + err


def test_the_report_compares_the_plan_with_its_own_runs_step_time(tmp_path):
    # A run resumed on another layout writes its own plan.json; its prediction was compared with the
    # median over both runs (here 1 s: 2.00 x the plan, where the run it predicted took 500 ms).
    row = {"loss": 3.0, "tokens_per_s": 1.0, "tflops_per_device": 1.0}
    for first, seconds in ((1, 1.0), (6, 0.5)):  # steps 1-5 on one layout, resumed to step 8 on another
        log = metrics.MetricsLog(tmp_path / "metrics.jsonl", total_steps=8, quiet=True, first=first)
        for step in range(first, first + (5 if first == 1 else 3)):
            log.write(dict(row, step=step, step_time_s=seconds))
        log.close()
    (tmp_path / "plan.json").write_text(json.dumps({"predicted": {"step_time_s": 0.5}}))
    code, out, err = _report(tmp_path, "--out", tmp_path / "r.png")
    assert code == 0 and "step time 500 ms (median of the run from step 6), predicted 500 ms (by its plan)" in out, \
        out + err
