import contextlib
import dataclasses
import io
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import holmes_jax
from holmes_jax import cli
from holmes_jax.config import ConfigError, ModelConfig, ParallelConfig
from holmes_jax.mesh.devices import build_mesh
from holmes_jax.models import presets
from holmes_jax.planning import Plan, plan, workload
from holmes_jax.planning.cli import main
from holmes_jax.planning.measured import Profile, StepProbe
from holmes_jax.planning.placement import place
from holmes_jax.planning.topology import Cluster, Link, Topology
from helpers import run_module

REPO = Path(__file__).resolve().parent.parent
TOPOLOGIES = REPO / "configs" / "topologies"
IB4_ROCE4 = str(TOPOLOGIES / "ib4_roce4.toml")
BF16 = ModelConfig(preset="7.5b", compute_dtype="bfloat16", remat=True)  # what fits 80 GB at few microbatches


def _cli(*args):
    """Runs the CLI in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        cli.run(main, list(args))
    return e.value.code, out.getvalue(), err.getvalue()


def test_ib4_roce4_7_5b_tp8_pp2_json():
    """The issue's acceptance command, as a subprocess."""
    r = run_module("holmes_jax.plan", "--topology", IB4_ROCE4, "--model", "7.5b", "--tp", "8", "--pp", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert list(out["mesh"].items()) == [("stage", 2), ("data", 4), ("tensor", 8)]
    assert out["stage_clusters"] == ["ib", "roce"]  # the stages in different clusters
    assert out["data_groups_nic"] == [["infiniband"], ["roce"]]  # each stage's data groups in one NIC class
    assert out["stage_nic"] == ["infiniband", "roce"]
    assert out["partition"] == "auto" and sum(out["stage_layers"]) == 36
    assert out["stage_layers"][0] >= out["stage_layers"][1]  # the faster NIC's stage gets at least as many
    assert set(out["predicted"]) >= {"step_time_s", "samples_per_s", "tflops_per_device", "flops_formula"}
    assert out["predicted"]["step_time_s"] > 0
    assert np.array(out["device_grid"]).shape == (2, 4, 8)


def test_table_output():
    code, out, _ = _cli("--topology", IB4_ROCE4, "--model", "7.5b", "--tp", "8", "--pp", "2", "--microbatches", "16",
                        "--schedule", "1f1b", "--dtype", "bfloat16", "--remat")
    assert code == 0
    assert "mesh stage=2 data=4 tensor=8" in out and "schedule 1f1b, 16 microbatches of 8" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("0 ", "1 ")) and "->" not in line]
    assert [row[:3] for row in rows] == [["0", "ib", "infiniband"], ["1", "roce", "roce"]]
    assert "0 -> 1    inter-cluster ethernet" in out
    assert "predicted step" in out and "Megatron with recompute" in out


def test_one_microbatch_is_singular():
    code, out, _ = _cli("--topology", IB4_ROCE4, "--model", "125m", "--pp", "2", "--microbatches", "1",
                        "--global-batch", "32", "--schedule", "gpipe", "--tp", "1")
    assert code == 0 and "schedule gpipe, 1 microbatch of 1 " in out, out


def test_module_is_callable_and_the_function_importable():
    p = holmes_jax.plan(IB4_ROCE4, "7.5b", ParallelConfig(tp=8, pp=2, microbatches=64, schedule="1f1b"))
    assert isinstance(p, Plan) and p.mesh == {"stage": 2, "data": 4, "tensor": 8}
    q = plan(IB4_ROCE4, ModelConfig(preset="7.5b"), ParallelConfig(tp=8, pp=2, microbatches=64, schedule="1f1b"))
    assert q.stage_layers == p.stage_layers and q.prediction == p.prediction
    data = json.loads(p.to_json())
    assert data["stage_layers"] == list(p.stage_layers) and data["schedule"] == "1f1b"
    assert "ib" in p.explain() and "roce" in p.explain()


def test_the_function_still_plans_after_the_command_module_is_imported():
    # `import holmes_jax.plan` binds the command's module to the function's name
    code = ("import sys, holmes_jax, holmes_jax.plan; p = holmes_jax.plan(sys.argv[1], '7.5b'); "
            "print(p.mesh, 'jax' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, IB4_ROCE4], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("}")[1].strip() == "False" and "'stage'" in r.stdout


def test_naive_placement_mixes_nic_classes_and_is_slower():
    args = ["--topology", IB4_ROCE4, "--model", "7.5b", "--tp", "8", "--pp", "2", "--microbatches", "16",
            "--schedule", "1f1b", "--dtype", "bfloat16", "--remat", "--json"]
    holmes, naive = (json.loads(_cli(*args, "--placement", p)[1]) for p in ("holmes", "naive"))
    assert holmes["data_groups_nic"] == [["infiniband"], ["roce"]]
    assert naive["data_groups_nic"] == [["infiniband", "roce"], ["infiniband", "roce"]]
    assert naive["links"]["data"][0]["via"] == "inter-cluster ethernet"
    assert naive["predicted"]["step_time_s"] > holmes["predicted"]["step_time_s"]


def test_unequal_clusters_and_three_nic_classes():
    unequal = plan(TOPOLOGIES / "ib3_roce5.toml", BF16, ParallelConfig(tp=8, pp=8, microbatches=32, schedule="1f1b"))
    assert unequal.placement.stage_clusters == ("ib",) * 3 + ("roce",) * 5
    three = plan(TOPOLOGIES / "three_clusters.toml", BF16, ParallelConfig(tp=8, pp=4, microbatches=16, schedule="1f1b"))
    assert three.placement.stage_nic == ("infiniband", "roce", "ethernet", "ethernet")
    assert [len(g) for g in three.placement.data_groups_nic] == [1, 1, 1, 1]


def test_sizes_left_out_are_chosen_and_fit():
    p = plan(TOPOLOGIES / "ib4_roce4.toml", BF16)
    assert p.pp * p.dp * p.tp == 64 and p.global_batch % (p.dp * p.microbatches) == 0
    assert p.prediction.fits and all(len(g) == 1 for g in p.placement.data_groups_nic)
    fixed = plan(TOPOLOGIES / "ib4_roce4.toml", BF16,
                 ParallelConfig(tp=p.tp, pp=p.pp, microbatches=p.microbatches, schedule=p.schedule))
    assert fixed.prediction.step_time_s == pytest.approx(p.prediction.step_time_s)
    # a chosen layout is never predicted slower than the hand-picked one of the paper
    paper = plan(TOPOLOGIES / "ib4_roce4.toml", BF16, ParallelConfig(tp=8, pp=2), auto={"microbatches", "schedule"})
    assert p.prediction.step_time_s <= paper.prediction.step_time_s


def test_mixed_stages_only_when_allowed():
    args = ["--topology", str(TOPOLOGIES / "ib3_roce5.toml"), "--model", "7.5b", "--tp", "8", "--pp", "2"]
    code, _, err = _cli(*args)
    assert code == 2 and err.startswith("error: pp = 2 is not allowed with tp = 8: stage 0 would span clusters")
    code, out, _ = _cli(*args, "--allow-mixed", "--json")
    assert code == 0 and json.loads(out)["mixed_stages"] == [0]
    assert json.loads(out)["data_groups_nic"][0] == ["infiniband", "roce"]


def test_build_mesh_from_a_plan_on_eight_cpu_devices():
    p = plan(TOPOLOGIES / "cpu_2x4.toml", "tiny", ParallelConfig(tp=2, pp=2, dp=2), global_batch=16, seq_len=128)
    assert p.placement.stage_clusters == ("ib", "roce")
    mesh = build_mesh(p)
    assert dict(mesh.shape) == p.mesh
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    assert [[[d.id for d in row] for row in stage] for stage in mesh.devices] == \
        [[[devices[i].id for i in row] for row in stage] for stage in p.grid]


@pytest.mark.parametrize("args, words", [
    (["--tp", "16"], ["tp = 16", "allowed"]),
    (["--tp", "8", "--pp", "3"], ["pp = 3", "allowed pp"]),
    # pp 3 has a layer a stage too, but 3 does not divide the 64 devices, and pp 1 spans both clusters
    (["--model", "tiny", "--tp", "1", "--pp", "8"], ["pp = 8 is not allowed: every pipeline stage needs a layer",
                                                    "allowed: pp 2, 4"]),
    (["--model", "tiny", "--tp", "8"], ["tp = 8 is not allowed: it must divide ModelConfig.num_heads = 4"]),
    (["--model", "gpt5"], ["ModelConfig.preset = 'gpt5' is not known"]),
    (["--tp", "zero"], ["argument --tp", "allowed: a positive integer"]),
    (["--partition", "best"], ["argument --partition: invalid choice"]),
    (["--stage-layers", "20,20"], ["stage_layers = [20, 20] is not allowed"]),
    (["--stage-layers", "\u00b2,2"], ["argument --stage-layers", "positive layer counts"]),  # was a traceback
    # in the flags' words, not ParallelConfig's
    (["--stage-layers", "18,18", "--pp", "4"], ["--stage-layers 18,18 is not allowed with --pp 4; allowed: 4 layer "
                                                "counts, one per stage (or leave --pp out)"]),
    (["--global-batch", "102", "--tp", "8", "--pp", "2"], ["global_batch = 102 is not allowed with dp = 4"]),
    (["--tp", "8", "--pp", "2", "--microbatches", "5"], ["microbatches = 5 is not allowed"]),
    # pp left to the search: the layouts that fit the clusters say why, not pp = 1's --allow-mixed
    (["--tp", "8", "--microbatches", "7"], ["microbatches = 7 is not allowed"]),
    (["--seq-len", "4096"], ["seq_len = 4096 is not allowed"]),
])
def test_bad_input_is_one_error_line_and_exit_2(args, words):
    argv = ["--topology", IB4_ROCE4] + (["--model", "7.5b"] if "--model" not in args else []) + args
    code, out, err = _cli(*argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ")
    for word in words:
        assert word in err


@pytest.mark.parametrize("make_args", [
    lambda tmp: ["--topology", str(tmp / "missing.toml"), "--model", "7.5b"],
    lambda tmp: ["--topology", str(tmp / "bad.toml"), "--model", "7.5b"],
    lambda tmp: ["--topology", IB4_ROCE4, "--model", "7.5b", "--tp", "16"],
    lambda tmp: ["--topology", IB4_ROCE4, "--model", "7.5b"] + ["--pp", "128"],
])
def test_cli_subprocess_errors(tmp_path, make_args):
    (tmp_path / "bad.toml").write_text('[[cluster]]\nname = "x"\nnic = "fibre"\nnodes = 1\ndevices_per_node = 8\n')
    r = run_module("holmes_jax.plan", *make_args(tmp_path))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_api_errors_are_config_errors():
    with pytest.raises(ConfigError, match="topology = 3 is not allowed"):
        plan(3, "7.5b")
    with pytest.raises(ConfigError, match="auto = .* is not allowed"):
        plan(IB4_ROCE4, "7.5b", auto={"layers"})


@pytest.mark.parametrize("ratios", [{"ib": "x", "roce": 1}, {"ib": True, "roce": 1}, {"ib": float("inf"), "roce": 1},
                                    [2, 1]])
def test_holmes_ratio_weights_that_are_not_numbers_are_config_errors(ratios):
    par = ParallelConfig(tp=8, pp=2, microbatches=16, partition="holmes-ratio")
    with pytest.raises(ConfigError, match=r"^ratios = .* is not allowed; allowed: a finite positive weight per "
                                          r"cluster name \(ib, roce\)"):  # "x" was numpy's ValueError
        plan(IB4_ROCE4, "7.5b", par, ratios=ratios)


def test_the_plan_header_counts_one_device_in_the_singular():
    one = Topology((Cluster("solo", "infiniband", 1, 1, device_tflops=100, device_memory_gb=50),))
    assert ": 1 device, 1 cluster(s)" in plan(one, "tiny", ParallelConfig(), global_batch=4).explain()
    assert ": 64 devices, 2 cluster(s)" in plan(IB4_ROCE4, BF16, ParallelConfig(tp=8, pp=2, microbatches=16)).explain()


def _answered_within(seconds, call):
    """call()'s result; a TimeoutError if it runs past `seconds` (a plan that would hang)."""
    def too_slow(*_):
        raise TimeoutError(f"the plan took over {seconds} s")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(seconds)
    try:
        return call()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_huge_global_batch_is_answered_at_once():
    """The microbatch search listed every divisor of a replica's samples: 2**64 never finished."""
    code, out, err = _answered_within(60, lambda: _cli("--topology", IB4_ROCE4, "--model", "7.5b", "--tp", "8",
                                                       "--pp", "2", "--global-batch", str(2 ** 64)))
    assert code == 2 and err.startswith("error: ") and "device memory" in err


def test_topology_with_an_infinite_rate_is_one_error_line(tmp_path):
    path = tmp_path / "inf.toml"
    path.write_text('[[cluster]]\nname = "x"\nnic = "roce"\nnodes = 1\ndevices_per_node = 2\nnic_gbps = inf\n')
    code, out, err = _cli("--topology", str(path), "--model", "tiny")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "nic_gbps = inf is not allowed; allowed: a finite number > 0" in err


def test_auto_finds_the_split_that_fits_memory_when_the_time_balanced_one_does_not():
    """Fast devices want most layers, but only the even split fits 63 GB: a plan, not 'no layout fits'."""
    topo = Topology((Cluster("fast", "infiniband", 4, 8, device_tflops=1000, device_memory_gb=63),
                     Cluster("slow", "infiniband", 4, 8, device_tflops=100, device_memory_gb=63)))
    p = plan(topo, "7.5b", ParallelConfig(tp=8, pp=2, microbatches=64, schedule="1f1b"))
    assert p.prediction.fits and p.stage_layers == (18, 18)
    assert not p.partitions["params"].fits  # 17,19 is over memory: the even split is the only one


def _tiny_profile(**changes):
    flops = workload.model_costs(presets.resolve(ModelConfig(preset="tiny")), 2, 256).layers[0].fwd_flops
    link = Link(10e9 / 8, 1e-5)
    prof = Profile("cpu", 2, 256, flops, 1e-3, 2e-3, (link, link), (link,))
    return dataclasses.replace(prof, **changes)


def _probes(**changes):
    fields = dict(dp=4, tp=1, microbatches=64, schedule="gpipe")
    return tuple(StepProbe(**dict(fields, stage_layers=layers, step_s=step_s, **changes))
                 for layers, step_s in (((1, 1), 1.0), ((2, 2), 2.0)))


@pytest.mark.parametrize("changes, words", [
    ({"layer_fwd_s": float("inf")}, "layer_fwd_s = inf is not allowed; allowed: a finite number > 0"),
    ({"layer_bwd_s": float("nan")}, "layer_bwd_s = nan is not allowed; allowed: a finite number >= 0"),
    ({"update_s_per_param": -1.0}, "update_s_per_param = -1.0 is not allowed"),
    ({"update_s_per_param": "x"}, "update_s_per_param = 'x' is not allowed"),
    ({"stage_links": (Link(10e9 / 8, float("inf")),)}, "stage_links[0].latency_s = inf is not allowed"),
    ({"step_probes": _probes(schedule="zb")}, "step_probes[0].schedule = 'zb' is not allowed"),
    ({"step_probes": _probes(microbatches=0)}, "step_probes[0].microbatches = 0 is not allowed"),
    # the fit predicts each probe: a MemoryError (a model of 2**40 layers), an OverflowError (its ticks)
    ({"step_probes": _probes()[:1] + (StepProbe((2 ** 40, 1), 4, 1, 64, "gpipe", 2.0),)},
     "step_probes[1].stage_layers = [1099511627776, 1] is not allowed; allowed: positive layer counts per stage, "
     "at most 1024 in all"),
    ({"step_probes": _probes(microbatches=2 ** 70)}, f"step_probes[0].microbatches = {2 ** 70} is not allowed; "
                                                     f"allowed: at most 4096"),
])
def test_profile_figures_the_cost_model_cannot_use_are_config_errors(changes, words):
    """They gave nan predictions, a negative step or a traceback (ValueError, ZeroDivisionError)."""
    with pytest.raises(ConfigError) as e:
        plan(TOPOLOGIES / "cpu_2x4.toml", "tiny", ParallelConfig(pp=2, dp=4, microbatches=64),
             profile=_tiny_profile(**changes))
    assert words in str(e.value)


def test_step_probes_of_seconds_past_int64_are_fitted():
    # numpy made an object array of the measured steps, and lstsq raised a UFuncTypeError
    probes = _probes()[:1] + (StepProbe((2, 2), 4, 1, 64, "gpipe", 2 ** 70),)
    p = plan(TOPOLOGIES / "cpu_2x4.toml", "tiny", ParallelConfig(pp=2, dp=4, microbatches=64),
             profile=_tiny_profile(step_probes=probes))
    assert any(note.startswith("profile: step probes") and "compute x" in note for note in p.notes)


@pytest.mark.parametrize("changes", [{"layer_fwd_s": 1e308}, {"step_probes": _probes(), "layer_fwd_s": 1e308},
                                     {"layer_bwd_s": 1e306}])
def test_a_step_too_slow_for_a_float_is_named_not_called_over_memory(changes):
    # it said "do not fit in device memory: stage 0 needs 1.26 GB, its devices have 80 GB"; with step
    # probes, lstsq on their infinite predictions raised a LinAlgError; a backward of 1e306 s (each
    # layer's FLOPs inf, a stage's their sums' difference, nan) gave a plan of nan seconds
    with np.errstate(over="ignore", invalid="ignore"), pytest.raises(ConfigError) as e:
        plan(TOPOLOGIES / "cpu_2x4.toml", "tiny", ParallelConfig(pp=2, dp=4, microbatches=64),
             profile=_tiny_profile(**changes))
    assert "the predicted step is not finite" in str(e.value) and "device memory" not in str(e.value)


def test_a_topology_too_slow_for_a_float_is_one_error_line(tmp_path):
    path = tmp_path / "slow.toml"
    path.write_text('[[cluster]]\nname = "x"\nnic = "roce"\nnodes = 2\ndevices_per_node = 4\ndevice_tflops = 1e-308\n')
    with np.errstate(over="ignore", invalid="ignore"):  # every layout: some are over memory too
        code, out, err = _cli("--topology", str(path), "--model", "1.3b")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "the predicted step is not finite" in err and "device memory" not in err


def test_a_reader_that_leaves_ends_the_command_quietly():
    """`plan ... | head -1`: the output's reader gone before the plan is written is exit 141, no traceback."""
    import os
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "holmes_jax.plan", "--topology", IB4_ROCE4, "--model", "7.5b",
                             "--tp", "8", "--pp", "2", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    proc.stdout.close()  # before the plan is computed, so its first write finds no reader
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGPIPE and err == b""


def test_a_pp_error_says_which_pp_fit_the_clusters():
    """ib3_roce5 with tp 8: pp 3 listed 1, 2, 4, 8 as allowed, and 1, 2, 4 were then refused as mixed stages."""
    ib3_roce5 = str(TOPOLOGIES / "ib3_roce5.toml")
    code, _, err = _cli("--topology", ib3_roce5, "--model", "7.5b", "--tp", "8", "--pp", "3")
    assert code == 2 and "allowed pp: 1, 2, 4, 8; every cluster holds whole stages only with pp 8 (the others " \
                         "need the planner's allow_mixed=True, --allow-mixed)" in err
    assert _cli("--topology", ib3_roce5, "--model", "7.5b", "--tp", "8", "--pp", "8")[0] == 0
    # with mixed stages allowed every pp that divides is listed
    code, _, err = _cli("--topology", ib3_roce5, "--model", "7.5b", "--tp", "8", "--pp", "3", "--allow-mixed")
    assert code == 2 and "allowed pp: 1, 2, 4, 8\n" in err


def test_a_tp_error_lists_tp_that_fit_every_cluster():
    """Nodes of 6 and 4 devices: tp 4 said 'tp dividing 6' and tp 3 'tp dividing 4', each refused by the other."""
    topo = Topology((Cluster("a", "infiniband", 1, 6), Cluster("b", "roce", 1, 4)))
    for tp in (3, 4):
        with pytest.raises(ConfigError, match=rf"^tp = {tp} is not allowed: .*; allowed: tp dividing 2$"):
            place(topo, tp, 1, allow_mixed=True)


def test_a_dp_that_does_not_divide_the_devices_is_named():
    """--dp 3 on 64 devices blamed 'pp = 21', a pp the user never gave (the search derived it from dp)."""
    code, _, err = _cli("--topology", IB4_ROCE4, "--model", "7.5b", "--dp", "3")
    assert code == 2 and "dp = 3 is not allowed with tp = 1: dp * tp must divide the 64 devices" in err
    assert "allowed dp: 1, 2, 4, 8, 16, 32, 64" in err and "pp = 21" not in err
    # a model shallower than that pp: its check of pp = 21 came first
    code, _, err = _cli("--topology", IB4_ROCE4, "--model", "125m", "--dp", "3")
    assert code == 2 and "first: dp = 3 is not allowed with tp = 1: dp * tp must divide the 64 devices" in err, err
    # with pp given, the one dp that goes with it (it offered dp 1, 2, 4, ..., which pp 2 refused too)
    code, _, err = _cli("--topology", IB4_ROCE4, "--model", "125m", "--dp", "3", "--pp", "2")
    assert code == 2 and "allowed with pp = 2, tp = 1: dp = 32" in err and "allowed dp: 1, 2" not in err, err


def test_a_topology_of_a_trillion_devices_is_refused_at_once(tmp_path):
    """The search listed every divisor of the device count one by one: 10**12 devices never finished."""
    huge = tmp_path / "huge.toml"
    huge.write_text('[[cluster]]\nname = "x"\nnic = "infiniband"\nnodes = 125000000000\ndevices_per_node = 8\n')
    code, out, err = _answered_within(20, lambda: _cli("--topology", str(huge), "--model", "tiny"))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "topology devices = 1000000000000" in err and "allowed: at most" in err


def test_a_million_layer_model_is_refused_at_once():
    """Every layer priced on every stage of every layout: over a minute and gigabytes."""
    with pytest.raises(ConfigError, match=r"^ModelConfig.num_layers = 1000000 is not allowed in a plan; "
                                          r"allowed: at most \d+$"):
        _answered_within(20, lambda: plan(IB4_ROCE4, ModelConfig(preset="tiny", num_layers=10 ** 6)))


def test_a_million_given_microbatches_are_refused_at_once():
    """The cost model walks every tick of the schedule: a million microbatches took minutes."""
    code, out, err = _answered_within(20, lambda: _cli(
        "--topology", IB4_ROCE4, "--model", "7.5b", "--tp", "8", "--pp", "2",
        "--global-batch", str(4 * 10 ** 6), "--microbatches", str(10 ** 6)))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: microbatches = 1000000 is not allowed in a plan; allowed: at most ")


@pytest.mark.parametrize("kwargs, message", [
    # each was a traceback (AttributeError, TypeError) or, allow_mixed, silently true
    (dict(parallel={"tp": 8}), "parallel = {'tp': 8} is not allowed; allowed: a ParallelConfig or None"),
    (dict(auto=3), "auto = 3 is not allowed; allowed: names among tp, pp, dp, microbatches, schedule"),
    (dict(auto=[["tp"]]), "auto = [['tp']] is not allowed; allowed: names among"),
    (dict(allow_mixed="no"), "allow_mixed = 'no' is not allowed; allowed: True or False"),
])
def test_api_arguments_of_the_wrong_type_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        plan(IB4_ROCE4, "7.5b", **kwargs)


def test_a_huge_predicted_time_prints_three_digits_and_an_exponent():
    """Seconds past 1000 were printed whole: a NIC typed a billion times too slow gave rows of digits."""
    slow = Topology((Cluster("slow", "ethernet", 2, 8, nic_gbps=1e-9),))
    text = plan(slow, "tiny", ParallelConfig(dp=16), global_batch=16).explain()
    assert re.search(r"\d{10}", text) is None
    assert re.search(r"predicted step \d\.?\d*e\+\d+ s ", text)


def test_the_command_loads_matplotlib_only_to_draw(tmp_path):
    # it took most of a second of every plan command's start
    script = ("import importlib, sys\nimportlib.import_module('holmes_jax.plan').main(sys.argv[1:])\n"
              "print('matplotlib' in sys.modules)")
    args = ["--topology", IB4_ROCE4, "--model", "tiny"]
    for extra, drawn in (([], "False"), (["--draw", str(tmp_path / "plan.png")], "True")):
        r = subprocess.run([sys.executable, "-c", script, *args, *extra], capture_output=True, text=True, cwd=REPO,
                           timeout=120)
        assert r.returncode == 0 and r.stdout.splitlines()[-1] == drawn, r.stderr
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_a_batch_that_no_dp_divides_names_the_smallest_dp():
    # it named the first layout's dp alone, the largest: "allowed: a multiple of 64", where 4 does
    args = ("--topology", str(TOPOLOGIES / "ib8.toml"), "--model", "tiny")
    code, _, err = _cli(*args, "--global-batch", "3")
    assert code == 2 and err.count("\n") == 1
    assert ("global_batch = 3 is not allowed: every data replica needs the same samples, and dp = 4, 8, 16, 32, 64 "
            "do not divide it; allowed: a multiple of 4, 8, 16, 32, 64 (the smallest: 4)") in err
    assert _cli(*args, "--global-batch", "4")[0] == 0


def test_given_microbatches_that_split_no_replica_name_every_dp_tried():
    # it named the first layout's dp = 32 alone ("each data replica's 16 samples ... a divisor of 16")
    code, _, err = _cli("--topology", IB4_ROCE4, "--model", "7.5b", "--microbatches", "7", "--global-batch", "512")
    assert code == 2 and err.count("\n") == 1
    assert "microbatches = 7 is not allowed" in err and "with dp = 1, 2, 4, 8, 16, 32 they do not" in err
    assert "allowed: a divisor of 512 (dp = 1), 256 (dp = 2), 128 (dp = 4), 64 (dp = 8), 32 (dp = 16), 16 (dp = 32)" in err


def test_given_microbatches_that_split_some_replicas_name_what_stopped_those_layouts():
    # 720720 = 16 * 45045: dp 32 and 64 do not divide it, dp 16 and below take 7 microbatches and are
    # over memory; it named dp = 32's batch misfit
    code, _, err = _cli("--topology", IB4_ROCE4, "--model", "7.5b", "--microbatches", "7", "--global-batch", "720720")
    assert code == 2 and "global_batch = 720720 is not allowed" not in err
    assert re.search(r"first: tp = \d+, pp = \d+, microbatches = 7, schedule \w+ do not fit in device memory", err)


@pytest.mark.parametrize("command, args", [
    ("plan", ["--topology", "", "--model", "tiny"]),
    ("plan", ["--topology", IB4_ROCE4, "--model", "tiny", "--profile", ""]),
    ("plan", ["--topology", IB4_ROCE4, "--model", "tiny", "--draw", ""]),
    ("report", [""]),
    ("report", ["runs/x", "--out", " "]),
    ("export", ["--workdir", "", "--out", "hf"]),
    ("generate", ["--workdir", "", "--prompt", "x"]),
    ("profile", ["--out", ""]),
])
def test_an_empty_path_is_one_error_line_not_the_current_folder(command, args, tmp_path, monkeypatch):
    # '' (an unset shell variable) was the current folder: `report ""` drew whatever run was there
    from holmes_jax import export, generate, profile, report

    mains = {"plan": main, "report": report.main, "export": export.main, "generate": generate.main,
             "profile": profile.main}
    monkeypatch.chdir(tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        cli.run(mains[command], args)
    assert e.value.code == 2 and err.getvalue().startswith("error: argument ") and err.getvalue().count("\n") == 1
    assert "is not allowed; allowed: a path" in err.getvalue() and not list(tmp_path.iterdir())
