"""The bench scripts' own logic, run through their functions (bench/ is not a package)."""

import pytest

from helpers import load_bench
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


def test_schedules_help_prints_its_whole_first_sentence(capsys):
    """--help printed the docstring's first line only, which ends mid-sentence ('..., each')."""
    with pytest.raises(SystemExit) as stop:
        load_bench("schedules").main(["--help"])
    assert stop.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "two processes, one stage each, each pinned to a core of its own." in out


def test_pipeline_microbatch_counts_keeps_each_count_once():
    """`--microbatches 4,4` built, timed and printed every configuration of m = 4 twice."""
    assert load_bench("pipeline").microbatch_counts("8,4,8,4") == [8, 4]
