"""What a run leaves for people to read: TensorBoard scalars equal to metrics.jsonl, the console's
ETA, plan.json, and the report drawn from them."""

import contextlib
import io
import json
import struct
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.record_writer import masked_crc32c

from holmes_jax import cli, metrics, report, train
from helpers import read_metrics, small_configs


def read_scalars(folder) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from every event file under `folder`, read as TFRecords (length,
    its CRC, the Event, its CRC) with the writer's own protobuf classes; CRCs checked."""
    scalars = {}
    for path in sorted(Path(folder).glob("events.out.tfevents.*")):
        raw, at = path.read_bytes(), 0
        while at < len(raw):
            header = raw[at:at + 8]
            (length,), (length_crc,) = struct.unpack("<Q", header), struct.unpack("<I", raw[at + 8:at + 12])
            data = raw[at + 12:at + 12 + length]
            (data_crc,) = struct.unpack("<I", raw[at + 12 + length:at + 16 + length])
            assert length_crc == masked_crc32c(header) and data_crc == masked_crc32c(data)
            at += 16 + length
            event = Event.FromString(data)
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


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
    log.write(dict(row, step=2, step_time_s=0.5))  # the first row counts as one step
    log.write(dict(row, step=4, step_time_s=1.0))  # two steps of 1 s
    assert log.eta_s(4) == pytest.approx(2.5 / 3 * 6)
    log.write(dict(row, step=10, step_time_s=1.0))
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("ETA 4s") and lines[1].endswith("ETA 5s")
    assert "ETA" not in lines[2]  # the run's last step


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


@pytest.mark.parametrize("files, message", [
    ({}, "no metrics.jsonl"),
    ({"metrics.jsonl": "{\"loss\": 1}\n"}, "metrics.jsonl:1 is not a metrics row"),
    ({"metrics.jsonl": "{\"step\": 1, \"loss\": 1}\n"}, "metrics.jsonl:1 is not a metrics row"),  # no step_time_s
    ({"metrics.jsonl": b"\xff\xfe\n"}, "metrics.jsonl:1 is not a metrics row"),  # not UTF-8
])
def test_the_report_refuses_what_is_not_a_run(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    code, _, err = _report(tmp_path)
    assert code == 2 and err.startswith("error:") and message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "report.png").exists()


def test_the_report_names_a_missing_workdir_not_its_default_out(tmp_path):
    code, _, err = _report(tmp_path / "absent")
    assert code == 2 and err.startswith("error: WORKDIR") and "holds no metrics.jsonl" in err, err


def test_a_last_row_cut_short_is_skipped_by_the_report_and_dropped_on_resume(tmp_path):
    row = {"loss": 3.0, "step_time_s": 0.1, "tokens_per_s": 1.0, "tflops_per_device": 1.0}
    whole = "".join(json.dumps(dict(row, step=s)) + "\n" for s in (1, 2))
    (tmp_path / "metrics.jsonl").write_text(whole + json.dumps(dict(row, step=3))[:20])  # a crash, a full disk
    assert [r["step"] for r in report.read_rows(tmp_path)] == [1, 2]
    code, out, err = _report(tmp_path, "--out", tmp_path / "r.png")
    assert code == 0 and "steps 1-2" in out, err
    log = metrics.MetricsLog(tmp_path / "metrics.jsonl", total_steps=4, quiet=True)  # the resumed run
    log.write(dict(row, step=3))
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == whole + json.dumps(dict(row, step=3)) + "\n"
    assert [r["step"] for r in report.read_rows(tmp_path)] == [1, 2, 3]
