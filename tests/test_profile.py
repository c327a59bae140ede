import dataclasses
import errno
import functools
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from holmes_jax.planning import workload
from holmes_jax.planning.measured import block_shape
from holmes_jax import build, cli, data, planning
from holmes_jax.config import ConfigError
from holmes_jax import profile
from helpers import small_configs


@pytest.mark.parametrize("zero1", [True, False])  # data groups timed with the sync the step runs
def test_profile_measures_layers_and_links_and_round_trips(tmp_path, zero1, monkeypatch):
    # 4 layers where splits are timed: at one layer a stage there is no other split
    # Whole steps timed once, one step after one untimed: the rounds and the pooling are
    # test_step_probes_are_timed_in_interleaved_rounds's; here every part must measure something.
    monkeypatch.setattr(profile, "profile_steps",
                        functools.partial(profile.profile_steps, rounds=1, steps=1, warmup_steps=1))
    cfgs = small_configs(tmp_path, "--gin.ParallelConfig.pp=2", f"--gin.ParallelConfig.zero1={zero1}",
                         f"--gin.ModelConfig.num_layers={2 if zero1 else 4}")
    setup = build.build(cfgs)
    result = profile.profile(setup, repeats=2, splits=0 if zero1 else 2)
    analytic = workload.model_costs(cfgs.model, result.micro_batch, result.seq_len).layers[0].fwd_flops
    assert result.layer_fwd_flops == pytest.approx(analytic, rel=0.15)  # XLA also counts softmax and norms
    assert result.layer_fwd_s > 0 and result.layer_bwd_s > 0
    assert 0 < result.update_s_per_param < result.layer_fwd_s / 1000  # AdamW touches a parameter a few times
    assert (result.compute_dtype, result.remat) == ("float32", "none")  # what the layer times were measured with
    assert result.block == block_shape(setup.plan.model)  # and on what blocks
    assert len(result.data_links) == 2 and all(l.gbps > 0 for l in result.data_links)
    assert len(result.stage_links) == 1 and result.stage_links[0].gbps > 0
    # whole steps of this layout (pp 2, dp 4 over 8 CPU devices) at 1 and 2 layers a stage
    assert [p.stage_layers for p in result.step_probes] == [(1, 1), (2, 2)]
    assert all((p.dp, p.tp, p.microbatches) == (4, 1, 1) and p.step_s > 0 for p in result.step_probes)
    if not zero1:  # the model's own step at the two splits the profile ranks fastest, the plan's pick first
        bare = dataclasses.replace(result, split_probes=())
        assert [p.stage_layers for p in result.split_probes] == profile.ranked_splits(setup, bare, 2)
        assert result.split_probes[0].stage_layers == planning.plan(
            setup.plan.topology, cfgs.model, dataclasses.replace(cfgs.parallel, partition="auto"),
            global_batch=cfgs.data.global_batch, seq_len=cfgs.data.seq_len, profile=bare).stage_layers
        assert all(sum(p.stage_layers) == cfgs.model.num_layers and p.step_s > 0 for p in result.split_probes)
    else:
        assert result.split_probes == ()
    path = tmp_path / "profile.json"
    path.write_text(result.to_json())
    assert profile.Profile.load(path) == result


def test_link_fit_separates_latency_and_bandwidth():
    # 1 ms latency, 8 Gb/s = 1e9 bytes/s: 1 MB takes 2 ms, 3 MB 4 ms.
    link = profile._fit([1_000_000, 3_000_000], [0.002, 0.004], 1.0)
    assert link.gbps == pytest.approx(8.0)
    assert link.latency_s == pytest.approx(0.001)


def test_a_bad_profile_file_is_a_config_error(tmp_path):
    (tmp_path / "p.json").write_text("{}")
    with pytest.raises(ConfigError, match="profile"):
        profile.Profile.load(tmp_path / "p.json")


def test_step_probes_are_timed_in_interleaved_rounds(tmp_path, monkeypatch):
    """Every layout compiled once, then timed layout by layout in each round (A B, A B), and each
    probe the median of its pooled steps."""
    setup = build.build(small_configs(tmp_path, "--gin.ParallelConfig.pp=2"))
    monkeypatch.setattr(profile, "_compile_step", lambda setup, layers, token_data: (layers, None))
    order, rounds = [], {(1, 1): [[1.0, 2.0], [3.0, 9.0]], (2, 2): [[4.0, 4.0], [5.0, 6.0]]}

    def time_steps(run, compiled, token_data, steps, warmup_steps):
        order.append(run)
        return rounds[run][sum(o == run for o in order) - 1]

    monkeypatch.setattr(profile, "_time_steps", time_steps)
    said = []
    probes = profile.profile_steps(setup, [(1, 1), (2, 2)], token_data=None, rounds=2, say=said.append)
    assert order == [(1, 1), (2, 2), (1, 1), (2, 2)]
    assert [p.step_s for p in probes] == [2.5, 4.5]  # medians of 1, 2, 3, 9 and of 4, 4, 5, 6
    # each round's own median: (1, 1) took 1.5 s, then 6 s, 300% apart, the layouts only 80%
    assert said[-5:] == [
        "profile: round 1/2 [1, 1]: 1500 ms a step", "profile: round 1/2 [2, 2]: 4000 ms a step",
        "profile: round 2/2 [1, 1]: 6000 ms a step", "profile: round 2/2 [2, 2]: 5500 ms a step",
        "profile: warning: the rounds of [1, 1] differed by 300.0% (1500, 6000 ms), more than the two fastest "
        "layouts differ (80.0%): on this host their order is noise; profile again at a quieter time"]


@pytest.mark.parametrize("rounds, warned", [
    ({(2, 1): [1.0, 1.1], (1, 2): [2.0, 2.1]}, False),  # rounds 10% apart, the splits 100%
    ({(2, 1): [1.0, 1.5], (1, 2): [1.1, 1.2]}, True),  # rounds 50% apart, the splits 9%
])
def test_the_profile_warns_where_its_rounds_differ_more_than_the_layouts(tmp_path, monkeypatch, rounds, warned):
    setup = build.build(small_configs(tmp_path, "--gin.ParallelConfig.pp=2"))
    monkeypatch.setattr(profile, "_compile_step", lambda setup, layers, token_data: (layers, None))
    order = []

    def time_steps(run, compiled, token_data, steps, warmup_steps):
        order.append(run)
        return [rounds[run][sum(o == run for o in order) - 1]] * steps

    monkeypatch.setattr(profile, "_time_steps", time_steps)
    said = []
    profile.profile_steps(setup, list(rounds), token_data=None, rounds=2, steps=3, say=said.append)
    assert any("warning" in line for line in said) == warned


def test_a_probe_compiles_from_the_states_shapes_alone(tmp_path):
    """`Setup.abstract_state` has the train state's structure, shapes, dtypes and shardings, so the
    profile compiles each probe's step without making a state for it, and that step runs a real one."""
    setup = build.build(small_configs(tmp_path, "--gin.ParallelConfig.pp=2", "--gin.ModelConfig.num_layers=4",
                                      "--gin.ParallelConfig.stage_layers=(3, 1)"))
    abstract, state = setup.abstract_state(), setup.init_state()
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
    for a, real in zip(jax.tree.leaves(abstract), jax.tree.leaves(state)):
        assert (a.shape, a.dtype, a.sharding) == (real.shape, real.dtype, real.sharding)
    tokens = data.load(setup.cfgs.data)
    batch = setup.batch("train", 0, tokens)
    from_shapes = build.make_train_step(setup).lower(abstract, batch).compile()
    expected = build.make_train_step(setup)(setup.init_state(), batch)[1]["loss"]
    assert float(from_shapes(state, batch)[1]["loss"]) == float(expected)


@pytest.mark.parametrize("flags", [["--out", "{tmp}/missing/p.json"], ["--out", "{tmp}"], ["--out", ""],
                                   ["--out", "{tmp}/p.json", "--repeats", "0"]])  # 0: a profile of NaNs
def test_bad_profile_flags_fail_before_profiling(tmp_path, monkeypatch, flags):
    def profiled(*args, **kwargs):
        raise AssertionError("profiled before the flags were checked")

    monkeypatch.setattr(profile.distributed, "initialize", lambda *args: None)
    monkeypatch.setattr(profile.build, "build", profiled)
    with pytest.raises(ConfigError, match="--out|--repeats"):
        profile.main([f.format(tmp=tmp_path) for f in flags])
    assert not (tmp_path / "p.json").exists()


def test_a_zero1_data_group_of_three_is_timed():
    # ZeRO-1's reduce-scatter needs a buffer that splits evenly over the group: was a ValueError
    mesh = Mesh(np.array(jax.devices()[:6]).reshape(2, 3, 1), ("stage", "data", "tensor"))
    links = profile.profile_data_groups(mesh, zero1=True, repeats=1)
    assert len(links) == 2 and all(l.gbps > 0 for l in links)


def test_stage_speeds_are_not_timed_where_one_process_holds_every_stage(tmp_path, monkeypatch):
    """One process holds both stages here (as in every one-process run): its time would be theirs
    together and the result is empty, but it compiled and timed the stack for that."""
    setup = build.build(small_configs(tmp_path, "--gin.ParallelConfig.pp=2"))
    monkeypatch.setattr(profile, "_lockstep_time", lambda *args, **kwargs: pytest.fail("timed for nothing"))
    assert profile.profile_stage_scale(setup.model, setup.mesh, 1, 1, 32, repeats=1) == ()


@pytest.mark.parametrize("owners, timed", [
    ([[0, 0], [1, 1]], True),  # a process a stage
    ([[0, 1], [2, 3]], True),  # several processes a stage
    ([[0, 1], [0, 1]], False),  # each process holds both stages
    ([[0, 0], [0, 1]], False),  # stage 0 only with process 0, which holds stage 1 too
    ([[0, 1]], False),  # one stage: nothing to compare
])
def test_stage_speeds_are_timed_where_every_stage_has_a_process_of_its_own(owners, timed):
    devices = np.array([[[SimpleNamespace(process_index=p)] for p in stage] for stage in owners])
    mesh = SimpleNamespace(shape={"stage": len(owners)}, devices=devices)
    assert profile.stage_speeds_timed(mesh) == timed


def test_a_stages_stack_is_made_without_the_whole_model(tmp_path, monkeypatch):
    """The layer and stage-speed timings need one stage's layers; they made every layer of the
    model (and its embedding) on one device first: more than a large model's run holds there."""
    setup = build.build(small_configs(tmp_path, "--gin.ParallelConfig.pp=2", "--gin.ModelConfig.num_layers=8"))
    monkeypatch.setattr(profile, "_lockstep_time", lambda *args, **kwargs: 1.0)
    monkeypatch.setattr(profile, "stage_speeds_timed", lambda mesh: True)
    initialised, init = [], profile.gpt.GPT.init
    monkeypatch.setattr(profile.gpt.GPT, "init", lambda self, seed: initialised.append(self.cfg.num_layers) or
                        init(self, seed))
    profile.profile_layer(setup.model, setup.mesh, 2, 1, 32, repeats=1)
    profile.profile_stage_scale(setup.model, setup.mesh, 2, 1, 32, repeats=1)
    assert initialised == [2, 2]  # was [8, 8]


def test_the_update_is_per_parameter_of_the_deepest_stage(tmp_path, monkeypatch):
    """The optimizer step over the whole mesh lasts as long as the stage with the most layers to
    update (the others skip their padding), whichever stage device 0 is on."""
    monkeypatch.setattr(profile, "_lockstep_time", lambda *args, repeats: 1.0)
    per_param = []
    for split in ("(1, 3)", "(3, 1)"):
        setup = build.build(small_configs(tmp_path, "--gin.ParallelConfig.pp=2", "--gin.ModelConfig.num_layers=4",
                                          f"--gin.ParallelConfig.stage_layers={split}"))
        per_param.append(profile.profile_update(setup))
    assert per_param[0] == pytest.approx(per_param[1])  # was 2x apart: device 0 updates 1 layer or 3


def _fake_profiling(monkeypatch, after=lambda: None):
    """main() without the minutes of profiling: a fixed Profile, `after` run when it is measured."""
    measured = profile.Profile("cpu", 1, 32, 1.3e7, 1e-3, 2e-3, (None,), ())

    def fake(setup, repeats, splits, say):
        after()
        return measured

    monkeypatch.setattr(profile.distributed, "initialize", lambda *args: None)
    monkeypatch.setattr(profile.build, "build", lambda cfgs: None)
    monkeypatch.setattr(profile, "profile", fake)
    return measured


def test_an_out_that_is_not_a_profile_is_refused_before_profiling_and_a_profile_is_replaced(tmp_path, monkeypatch):
    measured = _fake_profiling(monkeypatch, after=lambda: pytest.fail("profiled before --out was checked"))
    gin = tmp_path / "my_run.gin"
    gin.write_text("ModelConfig.preset = 'tiny'\n")
    with pytest.raises(ConfigError, match="exists and is not a profile"):  # was overwritten after profiling
        profile.main(["--out", str(gin)])
    assert gin.read_text() == "ModelConfig.preset = 'tiny'\n"
    earlier = tmp_path / "p.json"
    earlier.write_text(dataclasses.replace(measured, layer_fwd_s=5.0).to_json())
    _fake_profiling(monkeypatch)
    assert profile.main(["--out", str(earlier)]) == 0
    assert profile.Profile.load(earlier) == measured


def test_an_out_of_brackets_nested_too_deep_is_refused_before_profiling(tmp_path, monkeypatch):
    _fake_profiling(monkeypatch, after=lambda: pytest.fail("profiled before --out was checked"))
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="exists and is not a profile"):  # was a RecursionError traceback
        profile.main(["--out", str(nested)])


def test_only_process_0_checks_out_so_its_folder_need_not_exist_on_other_hosts(tmp_path, monkeypatch):
    # Played as process 1 of 2, its host without --out's folder: it exited at once with a flag error
    # while process 0 waited minutes for it at start-up. Process 0's verdict is every process's.
    _fake_profiling(monkeypatch)
    monkeypatch.setattr(profile.jax, "process_index", lambda: 1)
    said = {}

    def exchange(name, text, process_0_says=""):
        said[name] = text
        return [process_0_says if name == "profile --out" else text, text]

    monkeypatch.setattr(profile.distributed, "every_process", exchange)
    assert profile.main(["--out", str(tmp_path / "only-on-host-0" / "p.json")]) == 0
    assert said["profile --out"] == "" and not (tmp_path / "only-on-host-0").exists()
    refused = "--out 'p.json' exists and is not a profile; remove it or choose another"
    monkeypatch.setattr(profile.distributed, "every_process", functools.partial(exchange, process_0_says=refused))
    with pytest.raises(ConfigError, match="^--out 'p.json' exists and is not a profile"):  # process 0's, on every process
        profile.main(["--out", str(tmp_path / "p.json")])


def test_a_failed_write_is_one_error_and_the_profile_is_not_lost(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "out"
    folder.mkdir()
    measured = _fake_profiling(monkeypatch, after=folder.rmdir)  # the folder went while it profiled
    with pytest.raises(cli.RunError, match="cannot be written"):  # was a FileNotFoundError traceback
        profile.main(["--out", str(folder / "p.json")])
    assert measured.to_json() in capsys.readouterr().out  # minutes of measurement, still there


def test_a_profile_of_a_run_from_hugging_face_weights_does_not_read_them(tmp_path, monkeypatch):
    # profile_update's fresh state read the whole init_from folder (and failed where it is absent)
    _fake_profiling(monkeypatch)
    built = []
    monkeypatch.setattr(profile.build, "build", lambda cfgs: built.append(cfgs.model.init_from))
    assert profile.main(["--out", str(tmp_path / "p.json"), f"--gin.ModelConfig.init_from='{tmp_path / 'gone'}'"]) == 0
    assert built == [None]


def test_stdout_is_the_profile_alone_and_progress_goes_to_stderr(tmp_path, monkeypatch, capsys):
    # `profile ... > p.json` was the progress lines followed by the JSON: not a profile
    measured = _fake_profiling(monkeypatch)
    monkeypatch.setattr(profile, "profile", lambda setup, repeats, splits, say: say("profile: 1/6 timing") or measured)
    profile.main(["--out", str(tmp_path / "p.json"), "--gin.ParallelConfig.profile='old.json'"])
    out, err = capsys.readouterr()
    assert json.loads(out) == json.loads(measured.to_json())
    assert "profile: 1/6 timing" in err and "'old.json' is not read" in err


def test_a_write_cut_short_keeps_the_earlier_profile_whole(tmp_path, monkeypatch):
    earlier = tmp_path / "p.json"
    earlier.write_text(profile.Profile("cpu", 1, 32, 1.3e7, 5.0, 2e-3, (), ()).to_json())
    before = earlier.read_text()
    _fake_profiling(monkeypatch)

    def disk_full(self, data):
        with open(self, "wb") as f:
            f.write(data[:20])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", disk_full)
    with pytest.raises(cli.RunError, match="No space left on device"):
        profile.main(["--out", str(earlier)])
    assert earlier.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["p.json"]  # was half a file


@pytest.mark.parametrize("stages", [1, 2])
def test_splits_of_a_layout_with_one_split_say_why_none_were_timed(tmp_path, monkeypatch, stages):
    # one stage, or one layer a stage: planning takes the fastest of two or more timed splits
    setup = build.build(small_configs(tmp_path, f"--gin.ParallelConfig.pp={stages}"))
    monkeypatch.setattr(profile, "profile_layer", lambda *args: (1.3e7, 1e-3, 2e-3))
    monkeypatch.setattr(profile, "profile_stage_scale", lambda *args: ())
    monkeypatch.setattr(profile, "profile_update", lambda *args: 1e-9)
    monkeypatch.setattr(profile, "profile_data_groups", lambda *args, **kwargs: [None])
    monkeypatch.setattr(profile, "profile_steps", lambda *args, **kwargs: [])
    monkeypatch.setattr(profile.data, "load", lambda cfg: None)
    said = []
    assert profile.profile(setup, repeats=1, splits=2, say=said.append).split_probes == ()
    only = [2] if stages == 1 else [1, 1]
    assert said[-1] == f"profile: --splits 2 skipped: {only} is this layout's only split"  # was silent, or timed one
    assert not any("own step" in line for line in said)  # no part announced that is not timed


def test_help_names_the_run_config_flags_and_every_flag_has_help(capsys):
    with pytest.raises(SystemExit):
        profile.main(["--help"])
    text = capsys.readouterr().out
    assert "--gin_file FILE" in text and "the median kept" in text  # --gin_file was not mentioned
    options = text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    flags = [i for i, line in enumerate(options) if line.startswith("  -")]
    assert [options[i].split()[0] for i in flags] == ["-h,", "--out", "--repeats", "--splits"]
    for i in flags:  # its help on its own line (after two spaces) or on the next, indented further
        own = options[i].strip().split("  ", 1)[1:]
        assert own or (i + 1 < len(options) and options[i + 1].startswith(" " * 6)), options[i]


# 'x' was argparse's "invalid int value", no 'allowed'; '²' a digit to isdigit(), and int() raised
@pytest.mark.parametrize("count", ["1", "-2", "x", "\u00b2"])
def test_one_split_is_refused_before_profiling(tmp_path, monkeypatch, count):
    # planning's auto takes the fastest of two or more timed splits; one was timed, then noted as
    # "not of this layout"
    _fake_profiling(monkeypatch, after=lambda: pytest.fail("profiled before --splits was checked"))
    with pytest.raises(ConfigError, match=f"^--splits {count} is not allowed; allowed: 0 .none., or 2 or more"):
        profile.main(["--out", str(tmp_path / "p.json"), "--splits", count])


def test_an_unknown_flag_is_told_the_profiles_own_flags_too(tmp_path, monkeypatch):
    # argparse hands what it does not know to the gin parser, whose list of flags lacked --out and the others
    _fake_profiling(monkeypatch, after=lambda: pytest.fail("profiled with an unknown flag"))
    with pytest.raises(ConfigError, match=r"^unknown argument '--repeat-count'; allowed: .*--gin_file.*"
                                          r"--out, --repeats, --splits"):
        profile.main(["--out", str(tmp_path / "p.json"), "--repeat-count", "3"])


def test_each_part_is_said_before_it_is_timed(tmp_path, monkeypatch):
    """The parts before the whole steps took seconds (minutes on a large model) without a line."""
    setup = build.build(small_configs(tmp_path, "--gin.ParallelConfig.pp=2", "--gin.ModelConfig.num_layers=4"))
    said = []
    timed = lambda part, value: lambda *args, **kwargs: said.append(part) or value  # noqa: E731
    monkeypatch.setattr(profile, "profile_layer", timed("layer", (1.3e7, 1e-3, 2e-3)))
    monkeypatch.setattr(profile, "profile_stage_scale", timed("scale", ()))
    monkeypatch.setattr(profile, "profile_update", timed("update", 1e-9))
    monkeypatch.setattr(profile, "profile_data_groups", timed("data", [None, None]))
    monkeypatch.setattr(profile, "profile_stage_boundary", timed("boundary", None))
    monkeypatch.setattr(profile, "profile_steps", timed("steps", []))
    monkeypatch.setattr(profile.data, "load", lambda cfg: None)
    profile.profile(setup, repeats=1, splits=2, say=said.append)
    parts = ["layer", "scale", "update", "data", "boundary", "steps", "steps"]
    assert said[1::2] == parts
    for number, (line, part) in enumerate(zip(said[::2], parts), 1):
        assert line.startswith(f"profile: {number}/{len(parts)} timing "), said
    assert "2 layer(s)" in said[0] and "1 and 2 layers a stage" in said[10] and "2 splits" in said[12]
    assert said[2].endswith("each stage's speed: skipped, a process holds several stages")  # one process here
    said.clear()  # more splits asked than [2, 2] and the two one layer away: it said "the 5 splits"
    profile.profile(setup, repeats=1, splits=5, say=said.append)
    assert said[12].startswith("profile: 7/7 timing the model's own step at the 3 splits ranked fastest (of 5 asked")


def _one_device_with_parts_faked(tmp_path, monkeypatch):
    """A one-device setup whose layer, update and whole-step timings are faked (instant)."""
    setup = build.build(small_configs(tmp_path), jax.devices()[:1])
    monkeypatch.setattr(profile, "profile_layer", lambda *args: (1.3e7, 1e-3, 2e-3))
    monkeypatch.setattr(profile, "profile_update", lambda *args: 1e-9)
    monkeypatch.setattr(profile, "profile_steps", lambda *args, **kwargs: [])
    monkeypatch.setattr(profile.data, "load", lambda cfg: None)
    return setup


def test_a_part_with_nothing_to_time_says_it_is_skipped(tmp_path, monkeypatch):
    # one stage of one device: no stage speeds to compare, no data group, no boundary (each was "timing ...")
    setup = _one_device_with_parts_faked(tmp_path, monkeypatch)
    said = []
    result = profile.profile(setup, repeats=1, say=said.append)
    assert (result.stage_layer_scale, result.data_links, result.stage_links) == ((), (None,), ())
    assert said[1:5] == ["profile: 2/6 timing each stage's speed: skipped, one stage",
                         "profile: 3/6 timing the optimizer step",
                         "profile: 4/6 timing the data groups' sync: skipped, one replica a stage",
                         "profile: 5/6 timing the links between stages: skipped, one stage"]


def test_several_processes_without_data_groups_profile_without_a_warning(tmp_path, monkeypatch):
    # each process shared its links of no data group: numpy's "All-NaN slice encountered" on every rank
    setup = _one_device_with_parts_faked(tmp_path, monkeypatch)
    monkeypatch.setattr(profile.jax, "process_count", lambda: 2)  # two processes that measured alike
    monkeypatch.setattr(profile.multihost_utils, "process_allgather", lambda values: np.stack([values, values]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert profile.profile(setup, repeats=1, say=lambda *a: None).data_links == (None,)


def test_the_runs_own_profile_setting_is_not_read(tmp_path, monkeypatch):
    """A run's gin may name the profile this writes: not there yet, or measured before the model
    changed. It was read, and refused the profiling that would replace it."""
    stale = tmp_path / "stale.json"
    stale.write_text(profile.Profile("cpu", 1, 32, 1.3e7, 1e-3, 2e-3, (None,), (),
                                     block={"hidden": 999}).to_json())  # of another model
    measured = profile.Profile("cpu", 1, 32, 1.3e7, 1e-3, 2e-3, (None,), ())
    profiled = []
    monkeypatch.setattr(profile.distributed, "initialize", lambda *args: None)
    monkeypatch.setattr(profile, "profile", lambda setup, *args: profiled.append(setup) or measured)
    for named in ("missing.json", "stale.json"):
        out = tmp_path / "p.json"
        assert profile.main(["--out", str(out), f"--gin.ParallelConfig.profile='{tmp_path / named}'"]) == 0
        assert profiled[-1].cfgs.parallel.profile is None  # the run measured as planned without it
        assert profile.Profile.load(out) == measured


def test_the_docstring_names_every_key_the_profile_file_has():
    """--help (the docstring) is where a user reads what the written JSON holds."""
    link, probe = profile.Link(1e9, 1e-4), profile.StepProbe((1, 1), 4, 1, 1, "gpipe", 0.1)
    written = json.loads(profile.Profile("cpu", 1, 32, 1.3e7, 1e-3, 2e-3, (link,), (link,), 1e-9, (1.0,), (probe,),
                                         (probe,), "float32", "none", {"hidden": 64}).to_json())
    keys = set(written) | set(written["data_links"][0]) | set(written["step_probes"][0])
    assert [key for key in sorted(keys) if f"`{key}`" not in profile.__doc__] == []


def test_an_unwritable_folder_is_refused_before_profiling(tmp_path, monkeypatch):
    _fake_profiling(monkeypatch, after=lambda: pytest.fail("profiled before --out was checked"))
    monkeypatch.setattr(profile.os, "access", lambda path, mode: False)  # as a user without write permission sees it
    with pytest.raises(ConfigError, match="its folder is not writable"):  # was a PermissionError after profiling
        profile.main(["--out", str(tmp_path / "p.json")])


def test_a_device_file_is_asked_whether_it_may_be_written_not_its_folder(monkeypatch):
    # /dev/null was refused to any user but root: /dev is not theirs to write
    monkeypatch.setattr(profile.os, "access", lambda path, mode: str(path) != "/dev")  # as a user sees it
    assert profile._out_problem("/dev/null") == ""


def test_a_profile_written_through_a_link_keeps_the_link(tmp_path, monkeypatch):
    measured = _fake_profiling(monkeypatch)
    (tmp_path / "shared").mkdir()
    target, link = tmp_path / "shared" / "p.json", tmp_path / "p.json"
    target.write_text("")
    link.symlink_to(target)
    assert profile.main(["--out", str(link)]) == 0
    assert link.is_symlink() and profile.Profile.load(target) == measured


def test_a_profile_of_another_device_kind_is_refused_by_the_run(tmp_path):
    cfgs = small_configs(tmp_path)
    flops = workload.model_costs(cfgs.model, 16, 32).layers[0].fwd_flops  # one stage, dp 1: micro batch 16
    path = tmp_path / "p.json"
    for kind in ("NVIDIA H100 80GB HBM3", "cpu"):
        path.write_text(profile.Profile(kind, 16, 32, flops, 1e-3, 2e-3, (None,), ()).to_json())
        cfgs = small_configs(tmp_path, f"--gin.ParallelConfig.profile='{path}'")
        if kind != "cpu":  # was planned with an H100's layer times on CPU devices, silently
            with pytest.raises(ConfigError, match=r"measured on 'NVIDIA H100 80GB HBM3', but this run's devices "
                                                  r"are 'cpu'; allowed: a profile measured on them"):
                build.build(cfgs, jax.devices()[:1])
    notes = build.build(cfgs, jax.devices()[:1]).plan.notes
    assert any("layer times measured at micro batch 16 x seq 32" in note for note in notes), notes
