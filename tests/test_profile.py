import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from holmes_jax.planning import workload
from holmes_jax import build, data, planning
from holmes_jax.config import ConfigError
from holmes_jax import profile
from helpers import small_configs


@pytest.mark.parametrize("zero1", [True, False])  # data groups timed with the sync the step runs
def test_profile_measures_layers_and_links_and_round_trips(tmp_path, zero1):
    cfgs = small_configs(tmp_path, "--gin.ParallelConfig.pp=2", f"--gin.ParallelConfig.zero1={zero1}")
    setup = build.build(cfgs)
    result = profile.profile(setup, repeats=2, splits=0 if zero1 else 2)
    analytic = workload.model_costs(cfgs.model, result.micro_batch, result.seq_len).layers[0].fwd_flops
    assert result.layer_fwd_flops == pytest.approx(analytic, rel=0.15)  # XLA also counts softmax and norms
    assert result.layer_fwd_s > 0 and result.layer_bwd_s > 0 and result.achieved_tflops > 0
    assert 0 < result.update_s_per_param < result.layer_fwd_s / 1000  # AdamW touches a parameter a few times
    assert (result.compute_dtype, result.remat) == ("float32", "none")  # what the layer times were measured with
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
    probes = profile.profile_steps(setup, [(1, 1), (2, 2)], token_data=None, rounds=2)
    assert order == [(1, 1), (2, 2), (1, 1), (2, 2)]
    assert [p.step_s for p in probes] == [2.5, 4.5]  # medians of 1, 2, 3, 9 and of 4, 4, 5, 6


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
