"""A measured profile drives the plan: layer times and link figures replace the topology's defaults."""

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest

from holmes_jax.planning import workload
from holmes_jax import cli
from holmes_jax.config import ConfigError, ModelConfig, ParallelConfig
from holmes_jax.models import presets
from holmes_jax.planning.measured import Profile, StepProbe, block_shape
from holmes_jax.planning.topology import Link
from holmes_jax.planning import plan
from holmes_jax.planning.cli import main

TOPOLOGY = str(Path(__file__).resolve().parent.parent / "configs" / "topologies" / "cpu_2x4.toml")
MODEL = ModelConfig(preset="tiny", num_layers=8)
BATCH, SEQ = 16, 32  # dp 4, 4 microbatches: micro batch 1
FAST, SLOW = Link(10.0 * 1e9 / 8, 1e-5), Link(0.01 * 1e9 / 8, 1e-5)


def _profile(data_links=(FAST, FAST), stage_links=(FAST,), micro_batch=1, seq_len=SEQ) -> Profile:
    flops = workload.model_costs(presets.resolve(MODEL), micro_batch, seq_len).layers[0].fwd_flops
    return Profile("cpu", micro_batch, seq_len, flops, layer_fwd_s=1e-3, layer_bwd_s=2e-3,
                   data_links=tuple(data_links), stage_links=tuple(stage_links))


def _plan(prof, partition="auto", pp=2, config_profile=None, model=MODEL, tp=1):
    par = ParallelConfig(pp=pp, tp=tp, microbatches=4, partition=partition, profile=config_profile)
    return plan(TOPOLOGY, model, par, global_batch=BATCH, seq_len=SEQ, profile=prof)


def test_measured_layer_times_set_the_compute():
    p = _plan(_profile(), partition="uniform")
    # 4 layers per stage: forward 4 ms, backward 8 ms per microbatch (plus a small analytic head/embedding).
    assert p.prediction.stage_fwd_s[0] == pytest.approx(4e-3, rel=0.02)
    assert p.prediction.stage_bwd_s[0] == pytest.approx(8e-3, rel=0.02)
    assert p.prediction.stage_fwd_s[1] > 4e-3  # the head on the last stage
    # Twice as slow a measurement: compute doubles.
    slow = dataclasses.replace(_profile(), layer_fwd_s=2e-3, layer_bwd_s=4e-3)
    assert _plan(slow, partition="uniform").prediction.stage_fwd_s[0] == pytest.approx(8e-3, rel=0.02)
    assert any("layer times measured" in n for n in p.notes)


def test_layer_times_scale_to_the_plans_shape():
    at_half = _profile(seq_len=SEQ // 2)
    p = _plan(at_half, partition="uniform")
    cfg = presets.resolve(MODEL)
    scale = workload.model_costs(cfg, 1, SEQ).layers[0].fwd_flops / workload.model_costs(cfg, 1, SEQ // 2).layers[0].fwd_flops
    assert p.prediction.stage_fwd_s[0] == pytest.approx(4e-3 * scale, rel=0.02)
    assert any("scaled by analytic FLOPs" in n for n in p.notes)


def test_a_slow_data_group_raises_the_step_and_takes_layers_off_its_stage():
    fast = _plan(_profile())
    slow = _plan(_profile(data_links=(FAST, SLOW)))
    assert slow.prediction.stage_sync_s[1] > 10 * fast.prediction.stage_sync_s[1] / 4
    assert slow.prediction.step_time_s > fast.prediction.step_time_s
    assert any("data-group links for stage(s) 0, 1" in n for n in slow.notes)
    # A stage syncs its real layers only, so the slow group's stage gets fewer.
    assert slow.stage_layers[1] < fast.stage_layers[1]
    assert slow.prediction.step_time_s <= min(p.step_time_s for p in slow.partitions.values())


def test_measured_stage_speeds_take_layers_off_the_slow_stage():
    even = _plan(_profile())
    slow = _plan(dataclasses.replace(_profile(), stage_layer_scale=(0.5, 1.0)))
    assert slow.stage_layers[0] > even.stage_layers[0]  # stage 1 is slow: stage 0 takes more layers
    # stage 1 runs at the profile's (slowest) layer times, stage 0 at half
    uniform = _plan(dataclasses.replace(_profile(), stage_layer_scale=(0.5, 1.0)), partition="uniform")
    even_uniform = _plan(_profile(), partition="uniform")
    assert uniform.prediction.stage_bwd_s[0] == pytest.approx(even_uniform.prediction.stage_bwd_s[0] / 2, rel=0.02)
    assert any("stage speeds measured" in n for n in slow.notes)


def test_a_slow_boundary_raises_the_step():
    fast = _plan(_profile(), partition="uniform")
    slow = _plan(_profile(stage_links=(SLOW,)), partition="uniform")
    assert slow.prediction.p2p_s[0] > 100 * fast.prediction.p2p_s[0]
    assert slow.prediction.step_time_s > fast.prediction.step_time_s + 4 * slow.prediction.p2p_s[0]
    assert "profile: measured stage-boundary links" in slow.notes


def test_the_plan_shows_the_measured_links_its_times_come_from():
    # the table, plan.json and the drawing gave the topology's link speeds beside times priced
    # with the profile's measured ones (0.04 Gb/s drawn for a hop timed at 32.7 Gb/s)
    bare, measured = _plan(_profile(data_links=(), stage_links=()), partition="uniform"), _plan(
        _profile(data_links=(FAST, SLOW), stage_links=(SLOW,)), partition="uniform")
    routes = measured.placement
    assert [r.bytes_per_s for r in routes.data_routes] == [FAST.bytes_per_s, SLOW.bytes_per_s]
    assert routes.boundary_routes[0].bytes_per_s == SLOW.bytes_per_s
    assert [r.via for r in routes.data_routes] == [f"{r.via}, measured" for r in bare.placement.data_routes]
    text = measured.explain()
    assert f"{bare.placement.boundary_routes[0].via}, measured: {SLOW.gbps:.3g} Gb/s each" in text
    assert measured.to_dict()["links"]["data"][1]["gbps_per_transfer"] == pytest.approx(SLOW.gbps)


def test_an_unmeasured_boundary_keeps_the_topologys_link(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(_profile(stage_links=(None,)).to_json())  # "stage_links": [null]; was an AttributeError
    p = _plan(str(path), partition="uniform")
    assert p.prediction.p2p_s == pytest.approx(_plan(_profile(stage_links=()), partition="uniform").prediction.p2p_s)
    assert not any("stage-boundary" in n for n in p.notes)


def test_stage_speeds_of_another_pp_are_ignored_with_a_note():
    p = _plan(dataclasses.replace(_profile(), stage_layer_scale=(0.5, 1.0, 1.0, 1.0)), partition="uniform")
    assert p.prediction.step_time_s == pytest.approx(_plan(_profile(), partition="uniform").prediction.step_time_s)
    assert any("its 4 stage speeds ignored (this plan has pp = 2)" in n for n in p.notes)  # was silent


def test_links_of_another_pp_are_ignored_with_a_note():
    prof = _profile(data_links=(SLOW, SLOW, SLOW, SLOW), stage_links=(SLOW, SLOW, SLOW))
    p = _plan(prof, partition="uniform")
    bare = _plan(_profile(data_links=(), stage_links=()), partition="uniform")
    assert p.prediction.step_time_s == pytest.approx(bare.prediction.step_time_s)
    assert any("4 data-group links ignored (this plan has pp = 2)" in n for n in p.notes)
    assert any("3 stage-boundary links ignored" in n for n in p.notes)
    # Without a profile: the topology's figures, no notes.
    assert _plan(None).notes == ()


def _probes(prof, depths=(1, 2), extra_s=0.0, pp=2, dp=4, model=MODEL):
    """Step probes whose steps take what `prof`'s own uniform plans of those depths predict, plus `extra_s`."""
    probes = []
    for n in depths:
        par = ParallelConfig(pp=pp, dp=dp, microbatches=4, partition="uniform")
        p = plan(TOPOLOGY, dataclasses.replace(model, num_layers=pp * n), par, global_batch=BATCH, seq_len=SEQ,
                 profile=prof)
        probes.append(StepProbe((n,) * pp, dp, 1, 4, "gpipe", p.prediction.step_time_s + extra_s))
    return tuple(probes)


def test_step_probes_that_the_profile_predicts_change_nothing():
    bare = _plan(_profile(), partition="uniform")
    probed = _plan(dataclasses.replace(_profile(), step_probes=_probes(_profile())), partition="uniform")
    assert probed.prediction.step_time_s == pytest.approx(bare.prediction.step_time_s, rel=1e-6)
    assert any("compute x 1.00, fixed 0 ms a step" in n for n in probed.notes)


def test_step_probes_fit_a_fixed_part_a_step():
    probed = dataclasses.replace(_profile(), step_probes=_probes(_profile(), extra_s=0.05))
    p = _plan(probed, partition="uniform")
    assert p.prediction.stage_fixed_s == pytest.approx((0.05, 0.05), rel=1e-3)
    assert p.prediction.step_time_s == pytest.approx(_plan(_profile(), partition="uniform").prediction.step_time_s
                                                     + 0.05, rel=1e-3)
    assert "fixed" in p.explain()
    # A stage measured twice as fast pays half of it.
    scaled = dataclasses.replace(probed, stage_layer_scale=(0.5, 1.0))
    assert _plan(scaled, partition="uniform").prediction.stage_fixed_s == pytest.approx((0.025, 0.05), rel=0.05)


def test_step_probes_of_slower_steps_scale_the_compute():
    # Probes timed where layers run twice as slow as the profile says: the fit finds compute x 2,
    # and the plan predicts what a profile of the slower layers would, at every split.
    slow = dataclasses.replace(_profile(), layer_fwd_s=2e-3, layer_bwd_s=4e-3)
    probed = dataclasses.replace(_profile(), step_probes=_probes(slow, depths=(1, 3)))
    for partition in ("uniform", "auto"):
        p, want = _plan(probed, partition=partition), _plan(slow, partition=partition)
        assert p.stage_layers == want.stage_layers
        assert p.prediction.step_time_s == pytest.approx(want.prediction.step_time_s, rel=1e-3)
    assert any("compute x 2.00, fixed 0 ms a step" in n for n in _plan(probed).notes)


def test_step_probes_of_another_mesh_are_not_used():
    probed = dataclasses.replace(_profile(), step_probes=_probes(_profile(), extra_s=0.5, pp=4, dp=2))
    p = _plan(probed, partition="uniform")
    assert p.prediction.step_time_s == pytest.approx(_plan(_profile(), partition="uniform").prediction.step_time_s)
    assert any("step probes are not of this mesh" in n for n in p.notes)


def test_probes_of_one_depth_are_not_fitted_and_the_note_says_why():
    bare = _plan(_profile(), partition="uniform")
    for depths in ((1,), (2, 2)):  # a fit of compute and a fixed part needs two depths
        p = _plan(dataclasses.replace(_profile(), step_probes=_probes(_profile(), depths, extra_s=0.5)),
                  partition="uniform")
        assert p.prediction.step_time_s == pytest.approx(bare.prediction.step_time_s)
        assert not any("not of this mesh" in n for n in p.notes)  # they are: it said so before
        assert any(f"step probes of this mesh time one depth ({2 * depths[0]} layers)" in n for n in p.notes)


def test_a_profile_with_another_remat_scales_the_backward():
    full = dataclasses.replace(MODEL, remat="full")
    cfg = presets.resolve(MODEL)
    ratio = (workload.model_costs(dataclasses.replace(cfg, remat="full"), 1, SEQ).layers[0].bwd_flops
             / workload.model_costs(cfg, 1, SEQ).layers[0].bwd_flops)
    measured = dataclasses.replace(_profile(), remat="none")
    p = _plan(measured, partition="uniform", model=full)
    assert p.prediction.stage_fwd_s[0] == pytest.approx(4e-3, rel=0.02)
    assert p.prediction.stage_bwd_s[0] == pytest.approx(8e-3 * ratio, rel=0.02)  # was 8 ms: no recompute
    assert any(f"backward measured with remat 'none', scaled by analytic FLOPs x{ratio:.3g}" in n for n in p.notes)
    # Step probes ran with the profile's remat: predicted with it, they still fit compute x 1.
    probed = dataclasses.replace(measured, step_probes=_probes(measured))
    assert any("compute x 1.00, fixed 0 ms a step" in n for n in _plan(probed, partition="uniform", model=full).notes)


def test_a_profile_of_another_compute_dtype_is_refused():
    with pytest.raises(ConfigError, match="compute_dtype = 'float32' .* not allowed with ModelConfig.compute_dtype = 'bfloat16'"):
        _plan(dataclasses.replace(_profile(), compute_dtype="float32"),
              model=dataclasses.replace(MODEL, compute_dtype="bfloat16"))


def test_data_links_measured_at_another_dp_are_ignored_with_a_note():
    # profiled at pp 2, dp 4 (its step probes say so); this plan has dp 2, tp 2
    prof = _profile(data_links=(SLOW, SLOW))
    prof = dataclasses.replace(prof, step_probes=_probes(prof))
    p = _plan(prof, partition="uniform", tp=2)
    bare = _plan(_profile(data_links=()), partition="uniform", tp=2)
    assert p.prediction.stage_sync_s == pytest.approx(bare.prediction.stage_sync_s)
    assert any("data-group links measured at dp 4, tp 1 ignored (this plan has dp 2, tp 2)" in n for n in p.notes)


def _timed(times: dict, layers=8, dp=4, microbatches=4) -> Profile:
    probes = tuple(StepProbe(split, dp, 1, microbatches, "gpipe", t) for split, t in times.items())
    assert all(sum(split) == layers for split in times)
    return dataclasses.replace(_profile(), split_probes=probes)


def test_auto_takes_the_fastest_timed_split_and_keeps_the_cost_models_prediction(tmp_path):
    timed = _timed({(4, 4): 0.10, (6, 2): 0.08, (3, 5): 0.09})
    p = _plan(timed)
    assert p.stage_layers == (6, 2) and p.partitions["auto"].stage_layers == (6, 2)
    forced = plan(TOPOLOGY, MODEL, ParallelConfig(pp=2, microbatches=4, stage_layers=(6, 2)), global_batch=BATCH,
                  seq_len=SEQ, profile=_profile())
    assert p.prediction.step_time_s == pytest.approx(forced.prediction.step_time_s)  # predicted, not the 80 ms timed
    assert any("splits timed [6, 2] 80 ms, [3, 5] 90 ms, [4, 4] 100 ms: auto takes the fastest" in n for n in p.notes)
    # Other methods and explicit splits do not look at them; the JSON keeps them.
    assert _plan(timed, partition="uniform").stage_layers == (4, 4)
    path = tmp_path / "p.json"
    path.write_text(timed.to_json())
    assert Profile.load(path) == timed


def test_timed_splits_of_another_layout_or_model_are_not_used():
    own = _plan(_profile())
    for timed in (_timed({(5, 5): 0.1, (6, 4): 0.05}, layers=10), _timed({(4, 4): 0.1, (6, 2): 0.05}, dp=2),
                  _timed({(4, 4): 0.1, (6, 2): 0.05}, microbatches=2)):
        p = _plan(timed)
        assert p.stage_layers == own.stage_layers
        assert any("timed splits are not of this layout" in n for n in p.notes)
    with pytest.raises(ConfigError, match="split_probes"):
        _plan(_timed({(4, 4): 0.1, (6, 2): -1.0}))
    # one split of this layout (and one of another): nothing to take the fastest of, and the note says so
    one = dataclasses.replace(_profile(), split_probes=(StepProbe((6, 2), 4, 1, 4, "gpipe", 0.05),
                                                        StepProbe((4, 4), 2, 1, 4, "gpipe", 0.01)))
    p = _plan(one)
    assert p.stage_layers == own.stage_layers
    assert "profile: it timed one split of this layout, [6, 2]: nothing to compare; not used" in p.notes


def test_timed_splits_of_another_shape_or_remat_are_not_used():
    at_half = dataclasses.replace(_timed({(4, 4): 0.1, (6, 2): 0.05}), seq_len=SEQ // 2,
                                  layer_fwd_flops=_profile(seq_len=SEQ // 2).layer_fwd_flops)
    without_remat = dataclasses.replace(_timed({(4, 4): 0.1, (6, 2): 0.05}), remat="none")
    for timed, model in ((at_half, MODEL), (without_remat, dataclasses.replace(MODEL, remat="full"))):
        p = _plan(timed, model=model)  # was (6, 2): timed at seq 16, or without the recompute
        assert p.stage_layers != (6, 2)
        assert any("timed splits are not of this layout" in n for n in p.notes)


def test_profile_from_a_file_and_from_parallel_config(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(_profile(data_links=(FAST, SLOW)).to_json())
    by_arg = _plan(str(path))
    by_config = _plan(None, config_profile=str(path))
    assert by_arg.stage_layers == by_config.stage_layers
    assert by_arg.prediction.step_time_s == pytest.approx(by_config.prediction.step_time_s)
    assert by_arg.to_dict()["notes"] == list(by_arg.notes)
    assert "note: profile:" in by_arg.explain()


def test_parallel_config_profile_is_validated():
    with pytest.raises(ConfigError, match="ParallelConfig.profile"):
        ParallelConfig(profile="").validate()
    with pytest.raises(ConfigError, match="ParallelConfig.profile"):
        ParallelConfig(profile=3).validate()


def test_a_profile_of_another_model_or_bad_numbers_is_refused():
    other = dataclasses.replace(_profile(), layer_fwd_flops=_profile().layer_fwd_flops * 10)
    with pytest.raises(ConfigError, match="allowed: a profile of this model"):
        _plan(other)
    with pytest.raises(ConfigError, match="layer_fwd_s"):
        _plan(dataclasses.replace(_profile(), layer_fwd_s=0.0))
    with pytest.raises(ConfigError, match=r"stage_links\[0\]"):
        _plan(_profile(stage_links=(Link(-1.0 * 1e9 / 8, 0.0),)))


def test_a_profile_that_measured_other_blocks_is_refused_though_their_flops_match():
    mine = block_shape(presets.resolve(MODEL))
    assert sum(_plan(dataclasses.replace(_profile(), block=mine)).stage_layers) == 8  # its own blocks: planned from
    other = dict(mine, num_heads=2 * mine["num_heads"])  # the same FLOPs a block: only the record tells them apart
    with pytest.raises(ConfigError, match=rf"it measured blocks of hidden {mine['hidden']}, num_heads "
                                          rf"{other['num_heads']}, .*, but model 'tiny' has hidden {mine['hidden']}, "
                                          rf"num_heads {mine['num_heads']}, .*; allowed: a profile of this model$"):
        _plan(dataclasses.replace(_profile(), block=other))


def _cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        cli.run(main, list(args))
    return e.value.code, out.getvalue(), err.getvalue()


CLI = ["--topology", TOPOLOGY, "--model", "tiny", "--pp", "2", "--tp", "1", "--microbatches", "4", "--global-batch", str(BATCH),
       "--seq-len", str(SEQ)]


@pytest.mark.parametrize("content", ["{}", "not json", '{"micro_batch": 1}', None])
def test_cli_bad_profile_file_is_exit_2(tmp_path, content):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    code, out, err = _cli(*CLI, "--profile", str(path))
    assert code == 2 and out == ""
    assert err.startswith(f"error: profile {str(path)!r}: ") and err.count("\n") == 1 and "Traceback" not in err


def test_cli_profile_of_brackets_nested_too_deep_is_exit_2(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("[" * 100_000 + "]" * 100_000)  # was a RecursionError traceback, exit 1
    code, out, err = _cli(*CLI, "--profile", str(path))
    assert code == 2 and out == ""
    assert err.startswith(f"error: profile {str(path)!r}: not a readable holmes_jax profile") and "Traceback" not in err


def test_a_profile_error_names_the_setting_that_gave_the_file(tmp_path):
    missing = str(tmp_path / "missing.json")  # was "--profile ...", the plan CLI's flag, for the training config too
    with pytest.raises(ConfigError, match=f"^ParallelConfig.profile '{missing}': not a readable holmes_jax profile"):
        _plan(None, config_profile=missing)
    with pytest.raises(ConfigError, match=f"^profile '{missing}': not a readable holmes_jax profile"):
        _plan(missing)


def _with(**fields):
    raw = json.loads(_profile().to_json())
    raw.update(fields)
    return json.dumps(raw)


@pytest.mark.parametrize("content, words", [
    (_with(data_links=["x", None]), "data_links[0] = 'x' is not allowed; allowed: a table"),  # was "string indices"
    (_with(stage_links="fast"), "stage_links = 'fast' is not allowed; allowed: a list"),
    (_with(stage_links=[[1e9, 1e-5]]), "stage_links[0] = [1000000000.0, 1e-05] is not allowed; allowed: a table"),
    (_with(step_probes=[[2, 2]]), "step_probes[0] = [2, 2] is not allowed; allowed: a table of stage_layers"),
    (_with(stage_layer_scale=0.5), "stage_layer_scale = 0.5 is not allowed; allowed: a list"),
    (_with(remat=True), "remat = True is not allowed; allowed: one of 'none', 'full', 'dots' or null"),
    ("[1, 2]", "not a holmes_jax profile; allowed: a JSON table"),  # was "list indices must be integers"
], ids=["link-string", "links-string", "link-list", "probe-list", "scale-number", "remat-bool", "file-list"])
def test_a_malformed_profile_names_the_field(tmp_path, content, words):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as e:
        _plan(None, config_profile=str(path))
    assert str(e.value).startswith(f"ParallelConfig.profile {str(path)!r}: ") and words in str(e.value)


def test_cli_profile_changes_the_json(tmp_path):
    cfg4 = dataclasses.replace(MODEL, num_layers=4)
    flops = workload.model_costs(presets.resolve(cfg4), 1, SEQ).layers[0].fwd_flops
    prof = Profile("cpu", 1, SEQ, flops, 1e-3, 2e-3, (FAST, SLOW), (FAST,))
    path = tmp_path / "p.json"
    path.write_text(prof.to_json())
    code, out, _ = _cli(*CLI, "--json", "--profile", str(path))
    assert code == 0
    with_profile = json.loads(out)
    code, out, _ = _cli(*CLI, "--json")
    without = json.loads(out)
    assert with_profile["predicted"]["step_time_s"] != without["predicted"]["step_time_s"]
    slow_sync = with_profile["predicted"]["stage_sync_s"]
    assert slow_sync[1] > 10 * slow_sync[0]  # the slow data group
    assert with_profile["notes"] and without["notes"] == []


@pytest.mark.parametrize("link", [0, "", False, {}])
def test_a_damaged_link_is_refused_not_read_as_unmeasured(tmp_path, link):
    path = tmp_path / "p.json"
    path.write_text(_with(data_links=[link, None]))  # was read as null: the topology's link, silently
    with pytest.raises(ConfigError, match=r"data_links\[0\] = .* is not allowed; allowed: a table"):
        _plan(str(path))
    path.write_text(_with(data_links=[None, None]))  # null: not measured there
    assert _plan(str(path)).stage_layers
