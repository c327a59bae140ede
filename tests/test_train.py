import dataclasses
import gc
import math
import re
import signal
import sys
import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from holmes_jax import build, cli, configure, data, distributed, optimizer, train
from holmes_jax.config import ConfigError
from helpers import read_metrics, run_module, small_configs


def _step_losses(cfgs, devices, with_state=False):
    """Losses of three steps on one fixed batch, warmed up over the three (the full learning rate
    twice on one batch overshoots: the loss rose), and the state after them, its updates settled,
    where `with_state`."""
    cfgs = dataclasses.replace(cfgs, train=dataclasses.replace(cfgs.train, warmup_steps=3))
    setup = build.build(cfgs, devices)
    step = build.make_train_step(setup)
    from holmes_jax import data

    tokens = data.load(cfgs.data)
    state = setup.init_state()
    batch = setup.batch("train", 0, tokens)
    losses = []
    for _ in range(3):
        state, out = step(state, batch)
        losses.append(float(out["loss"]))
    return (losses, setup.settled(state)) if with_state else losses


def test_same_batch_same_loss_on_every_mesh(tmp_path):
    # data parallel alone (its gradients reduced, ZeRO-1's updates gathered), then tensor parallel
    # beside data parallel with the batch in microbatches: each layout compiles its own step, so
    # the second covers tensor parallelism and microbatches in one
    devices = jax.devices()
    ref = _step_losses(small_configs(tmp_path, "--gin.ParallelConfig.dp=1"), devices[:1])
    for bindings in (["--gin.ParallelConfig.dp=8"],
                     ["--gin.ParallelConfig.dp=2", "--gin.ParallelConfig.tp=4", "--gin.ParallelConfig.microbatches=2"]):
        got = _step_losses(small_configs(tmp_path, *bindings), devices)
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5, err_msg=str(bindings))
    assert ref[2] < ref[0]


def test_zero1_updates_settled_at_the_next_step_equal_updates_applied_at_once(tmp_path):
    """ZeRO-1 keeps each replica's update until the next step gathers it (`pending`); without
    ZeRO-1 every update is applied in its own step. Same losses, and the same parameters once the
    last updates are settled."""
    devices = jax.devices()
    at_once, plain = _step_losses(small_configs(tmp_path, "--gin.ParallelConfig.dp=8",
                                                "--gin.ParallelConfig.zero1=False"), devices, True)
    later, zero1 = _step_losses(small_configs(tmp_path, "--gin.ParallelConfig.dp=8"), devices, True)
    np.testing.assert_allclose(later, at_once, rtol=0, atol=1e-5)
    assert later[2] < later[0]
    for a, b in zip(jax.tree.leaves(zero1["params"]), jax.tree.leaves(plain["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout", [["--gin.ParallelConfig.dp=8"],
                                    ["--gin.ParallelConfig.dp=4", "--gin.ParallelConfig.tp=2", "--gin.ParallelConfig.zero1=False"]])
def test_data_traffic_in_bfloat16_trains_like_float32(tmp_path, layout):
    """Gradients reduced and (ZeRO-1) updates gathered in bfloat16: losses near float32's, and
    the data replicas' parameters still bit for bit equal (each adds the same rounded update)."""
    devices = jax.devices()
    ref = _step_losses(small_configs(tmp_path, *layout), devices)
    got, state = _step_losses(small_configs(tmp_path, *layout, "--gin.ParallelConfig.grad_reduce_dtype='bfloat16'",
                                            "--gin.ParallelConfig.update_gather_dtype='bfloat16'"), devices, True)
    assert got[0] == ref[0]  # the first loss comes before any update
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-3)
    assert got[2] < got[0]
    for leaf in jax.tree.leaves(state["params"]):
        by_place = {}
        for shard in leaf.addressable_shards:
            by_place.setdefault(str(shard.index), []).append(np.asarray(shard.data))
        assert all(len(copies) > 1 for copies in by_place.values())  # replicated over `data`
        for first, *others in by_place.values():
            for other in others:
                np.testing.assert_array_equal(other, first)
    for knob in ("grad_reduce_dtype", "update_gather_dtype"):
        with pytest.raises(ConfigError, match=knob):
            build.build(small_configs(tmp_path, f"--gin.ParallelConfig.{knob}='float16'"))


def test_data_traffic_crosses_in_the_asked_dtype(tmp_path):
    """The step as JAX hands it to XLA: with ZeRO-1 the only reduce-scatters are the gradients'
    over `data` and the only all-gathers the updates', each in the asked dtype. (XLA:GPU passes
    bfloat16 to NCCL as it is; XLA:CPU widens a bfloat16 reduction to float32 when it compiles,
    so the compiled CPU step cannot show it.)"""
    from holmes_jax import data

    def operand_types(wire):
        cfgs = small_configs(tmp_path, "--gin.ParallelConfig.dp=2", "--gin.ParallelConfig.tp=2",
                             "--gin.ParallelConfig.pp=2", "--gin.ModelConfig.num_layers=3",
                             "--gin.ParallelConfig.stage_layers=(2,1)", "--gin.ParallelConfig.microbatches=2",
                             f"--gin.ParallelConfig.grad_reduce_dtype='{wire}'",
                             f"--gin.ParallelConfig.update_gather_dtype='{wire}'")
        setup = build.build(cfgs)
        # the state's shapes and shardings lower the same step as a state made (the step's
        # in_shardings are fixed), without compiling and running the fresh state's program
        step = build.make_train_step(setup).lower(setup.abstract_state(), setup.batch("train", 0, data.load(cfgs.data)))
        if wire == "bfloat16":
            step.compile()  # on CPU too, where XLA widens it
        # over `data`, the groups {0, 2}, ... of mesh (2, 2, 2) (the boundary's activations are
        # gathered over `tensor`, in the compute dtype)
        found = {op: re.findall(rf'"stablehlo.{op}".*?replica_groups = dense<([^>]*)>.*?\}}>?\)? : '
                                rf'\(tensor<(?:\d+x)*(\w+)>\)', step.as_text(), re.S)
                 for op in ("reduce_scatter", "all_gather")}
        return {op: [dtype for groups, dtype in ops if groups == "[[0, 2], [1, 3], [4, 6], [5, 7]]"]
                for op, ops in found.items()}

    fp32, bf16 = operand_types("float32"), operand_types("bfloat16")
    for op in fp32:
        assert len(fp32[op]) == len(bf16[op]) > 0, op
        assert set(fp32[op]) == {"f32"} and set(bf16[op]) == {"bf16"}, op


@pytest.mark.parametrize("zero1", [True, False])
def test_parameters_and_optimizer_state_carry_their_shardings(tmp_path, zero1):
    cfgs = small_configs(tmp_path, "--gin.ParallelConfig.dp=2", "--gin.ParallelConfig.tp=4",
                         f"--gin.ParallelConfig.zero1={zero1}")
    state = build.build(cfgs).init_state()
    params = state["params"]
    # Block leaves are staged: (stage, layer, ...).
    assert params["blocks"]["q"]["kernel"].sharding.spec == P("stage", None, None, "tensor")
    assert params["blocks"]["down"]["kernel"].sharding.spec == P("stage", None, "tensor", None)
    assert params["embed"]["tokens"]["embedding"].sharding.spec == P("tensor", None)  # vocab-parallel
    adam = state["opt_state"][0]
    mu_q, nu_down = adam.mu["blocks"]["q"]["kernel"], adam.nu["blocks"]["down"]["kernel"]
    if zero1:  # moments split over `data` inside a layer, on top of the parameter's own `tensor` split
        assert mu_q.sharding.spec == P("stage", None, "data", "tensor")
        assert nu_down.sharding.spec == P("stage", None, "tensor", "data")
        assert adam.mu["embed"]["tokens"]["embedding"].sharding.spec == P("tensor", "data")
        shard = mu_q.addressable_shards[0].data
        assert shard.shape == (1, 2, 32, 16)
    else:
        assert mu_q.sharding.spec == P("stage", None, None, "tensor")
    assert adam.count.sharding.spec == P()


def test_stop_and_resume_gives_the_uninterrupted_losses(tmp_path):
    full = tmp_path / "full"
    train.run(small_configs(full), quiet=True)
    split = tmp_path / "split"
    train.run(small_configs(split, "--gin.TrainConfig.stop_after=3", "--gin.CheckpointConfig.every=3"), quiet=True)
    assert [r["step"] for r in read_metrics(split)] == [1, 2, 3]
    train.run(small_configs(split), quiet=True)
    want = {r["step"]: r["loss"] for r in read_metrics(full)}
    got = {r["step"]: r["loss"] for r in read_metrics(split)}
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert [r.get("resumed_from") for r in read_metrics(split)] == [None] * 3 + [3, None, None]  # for the report
    for step in range(1, 7):
        assert got[step] == pytest.approx(want[step], abs=1e-6), step
    assert (split / "config.gin").read_text().count("TrainConfig.steps = 6") == 1


def test_checkpoint_restores_onto_a_different_mesh(tmp_path):
    cfgs = small_configs(tmp_path, "--gin.ParallelConfig.dp=8", "--gin.TrainConfig.steps=2")
    train.run(cfgs, quiet=True)
    saved = build.build(cfgs)
    from holmes_jax.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path / "checkpoints", cfgs.checkpoint)
    on_data8 = ckpt.restore(2, saved.abstract_canonical())
    other = build.build(small_configs(tmp_path, "--gin.ParallelConfig.dp=2", "--gin.ParallelConfig.tp=4"))
    on_tp4 = ckpt.restore(2, other.abstract_canonical())
    ckpt.close()
    assert on_tp4["params"]["blocks"]["q"]["kernel"].sharding.spec == P(None, "data", "tensor")  # canonical layout
    assert on_tp4["params"]["blocks"]["q"]["kernel"].sharding.mesh.shape["tensor"] == 4
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), on_data8, on_tp4)
    assert int(on_tp4["step"]) == 2


@pytest.mark.parametrize("layout, ways", [((2, 4, 1), 8), ((4, 1, 2), 8), ((2, 2, 2), 8), ((1, 8, 1), 8)])
def test_a_save_spreads_the_checkpoint_over_every_device(tmp_path, layout, ways):
    # The canonical state a save makes (and a restore reads) was whole on every stage and data
    # replica: at every save each device held the whole model, several times its train state.
    pp, dp, tp = layout
    setup = build.build(small_configs(tmp_path, f"--gin.ParallelConfig.pp={pp}", f"--gin.ParallelConfig.dp={dp}",
                                      f"--gin.ParallelConfig.tp={tp}", f"--gin.ParallelConfig.microbatches={pp}",
                                      "--gin.ModelConfig.num_layers=4"))
    leaves = jax.tree.leaves(setup.abstract_canonical())
    whole = sum(x.size * x.dtype.itemsize for x in leaves)
    per_device = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)
    # tensor replicates the norms and biases, so (2, 2, 2) spreads a little less than 8 ways
    assert per_device <= whole / ways * (1.2 if tp > 1 else 1.001)
    compiled = setup.canonical.lower(setup.abstract_state()).compile().memory_analysis()
    assert compiled.output_size_in_bytes == pytest.approx(per_device, rel=0.01)  # what a save makes


def test_a_save_a_resume_and_a_fresh_state_gather_no_whole_model_on_a_device(tmp_path):
    # Turning the canonical state into the staged one, XLA gathered whole leaves on every device:
    # a resume read the whole model onto each device, and a fresh state made it there first; a
    # save gathered each stage's settled parameters on every device before spreading them.
    setup = build.build(small_configs(tmp_path, "--gin.ParallelConfig.pp=2", "--gin.ParallelConfig.dp=4",
                                      "--gin.ParallelConfig.microbatches=2", "--gin.ModelConfig.num_layers=4",
                                      "--gin.ModelConfig.hidden=256", "--gin.ModelConfig.ffn_hidden=1024",
                                      "--gin.ParallelConfig.stage_layers=[3,1]"))
    params = jax.eval_shape(lambda: setup.model.init(0))
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    resume = setup.staged.lower(setup.abstract_canonical()).compile().memory_analysis()
    assert resume.argument_size_in_bytes + resume.temp_size_in_bytes < whole  # 1.5x before
    fresh = setup._jitted_fresh_state.lower().compile().memory_analysis()
    assert fresh.temp_size_in_bytes < whole / 2  # 2.4x before
    save = setup.canonical.lower(setup.abstract_state()).compile().memory_analysis()
    assert save.temp_size_in_bytes < whole  # 1.5x before


def test_a_save_settles_the_pending_updates_exactly_as_the_step_does(tmp_path):
    # A save adds each replica's shard of the pending updates where it lies; the step's settle
    # gathers them first. The checkpoint must hold the same parameters, bit for bit.
    cfgs = small_configs(tmp_path, "--gin.ParallelConfig.pp=2", "--gin.ParallelConfig.dp=4",
                         "--gin.ParallelConfig.microbatches=2", "--gin.ModelConfig.num_layers=4",
                         "--gin.ParallelConfig.stage_layers=[3,1]", "--gin.ParallelConfig.update_gather_dtype='bfloat16'")
    setup = build.build(cfgs)
    step, tokens, state = build.make_train_step(setup), data.load(cfgs.data), setup.init_state()
    for k in range(2):
        state, _ = step(state, setup.batch("train", k, tokens))
    assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(state["pending"]) if x.size)
    saved = setup.canonical(state)
    settled = jax.jit(setup.pipeline.to_canonical)(setup.settled(state))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), saved, settled)


def test_metrics_rows_hold_the_contract_fields(tmp_path):
    summary = train.run(small_configs(tmp_path, "--gin.TrainConfig.log_every=2", "--gin.TrainConfig.eval_every=3"),
                        quiet=True)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 6]  # every 2nd, the first and each validation step
    for row in rows:
        for key in ("step", "loss", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "lr", "grad_norm"):
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (key, row)  # null: not finite
        assert row["tokens_per_s"] == pytest.approx(16 * 32 / row["step_time_s"])
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert summary["final_loss"] == rows[-1]["loss"]


def test_a_checkpoint_saves_time_is_not_step_time(tmp_path, monkeypatch):
    from holmes_jax.checkpoint import Checkpointer

    save = Checkpointer.save
    monkeypatch.setattr(Checkpointer, "save", lambda *a, **k: (time.sleep(3), save(*a, **k)))  # a slow disk
    # saves at step 2, which step 3 follows, and at the last step, 3
    train.run(small_configs(tmp_path, "--gin.CheckpointConfig.every=2", "--gin.TrainConfig.steps=3"),
              devices=jax.devices()[:1], quiet=True)
    times = {r["step"]: r["step_time_s"] for r in read_metrics(tmp_path)}
    assert sorted(times) == [1, 2, 3] and max(times.values()) < 1.5, times  # each save took over 3 s


# The data refused: the furthest a bad input gets (JAX's backend started, the run built); every
# other case here stops earlier on the same way through train.main.
DATA_REFUSED = (["--gin.DataConfig.source=/nonexistent/text"], "DataConfig.source")
BAD_INPUT = [
    (["--gin.TrainConfig.stepz=3"], "stepz"),
    (["--gin.NoSuchConfig.x=1"], "NoSuchConfig"),
    (["--gin.ParallelConfig.schedule=zigzag"], "ParallelConfig.schedule"),
    (["--gin.ParallelConfig.tp=3"], "tp = 3"),
    DATA_REFUSED,
    (["--gin_file", "/nonexistent.gin"], "nonexistent.gin"),
    (["--bogus"], "--bogus"),
]


def _one_error_line(stderr: str, names: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and names in lines[0], stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("args, names", BAD_INPUT)
def test_bad_input_exits_2_with_one_error_line_and_writes_nothing(tmp_path, monkeypatch, capsys, args, names):
    # In this process, through what `python -m holmes_jax.train` runs (cli.run(train.main)): a
    # process start-up (JAX's import) for each case cost seconds; the test below runs one in a
    # process of its own. An exception other than our errors (a traceback) would escape cli.run.
    monkeypatch.setattr(distributed, "_info", None)  # train.main's start-up, as in a new process ...
    monkeypatch.setattr(distributed, "_network", [])  # ... and none of it left for later tests
    workdir = tmp_path / "wd"
    with pytest.raises(SystemExit) as exited:
        cli.run(train.main, [f"--gin.TrainConfig.workdir={workdir}", *args])
    stderr = capsys.readouterr().err
    assert exited.value.code == 2, stderr
    _one_error_line(stderr, names)
    assert not workdir.exists()


def test_bad_input_in_a_process_of_its_own_exits_2_with_one_error_line_and_writes_nothing(tmp_path):
    # The case that gets furthest, in a real process: its exit status, and a stderr with nothing
    # but the error line (no warning of JAX's start-up, no traceback).
    args, names = DATA_REFUSED
    workdir = tmp_path / "wd"
    result = run_module("holmes_jax.train", f"--gin.TrainConfig.workdir={workdir}", *args)
    assert result.returncode == 2, result.stderr
    _one_error_line(result.stderr, names)
    assert not workdir.exists()


def _in_use(workdir) -> str:
    """The refusal of a run on `workdir` while another run holds it, as a pattern."""
    return (rf"TrainConfig.workdir = '{re.escape(str(workdir))}' is in use by another run \(process \d+ on .*, "
            rf"which holds {re.escape(str(workdir / '.lock'))}\); allowed: a workdir no other run is using")


@pytest.mark.parametrize("checkpoints", [True, False])
def test_a_second_run_on_a_workdir_in_use_is_refused_before_it_writes_there(tmp_path, checkpoints):
    # With checkpoints, the second run deleted the first's save in flight as a failed save's
    # leftover, then saved the same steps; without, there was no lock: both ran, their rows
    # interleaved in metrics.jsonl and the second rewrote config.gin. (flock is per open file:
    # a lock held here stands for another process's.)
    flags = (f"--gin.CheckpointConfig.enabled={checkpoints}", "--gin.TrainConfig.steps=1")
    held = train.lock_workdir(tmp_path)  # the first run's
    in_flight = tmp_path / "checkpoints" / "5.orbax-checkpoint-tmp"  # its async save
    in_flight.mkdir(parents=True)
    try:
        with pytest.raises(ConfigError, match=_in_use(tmp_path)):
            train.run(small_configs(tmp_path, *flags), devices=jax.devices()[:1], quiet=True)
        assert in_flight.is_dir()
        assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "config.gin").exists()
    finally:
        held.close()
    in_flight.rmdir()
    train.run(small_configs(tmp_path, *flags), devices=jax.devices()[:1], quiet=True)  # the lock went with it
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_a_workdir_whose_lock_file_cannot_be_opened_is_bad_input(tmp_path):
    (tmp_path / ".lock").mkdir()
    with pytest.raises(ConfigError, match=r"TrainConfig.workdir = .* cannot be used: Is a directory \(.*\.lock\)"):
        train.lock_workdir(tmp_path)


def test_clipping_scales_to_the_limit_and_reports_the_norm_before_it():
    import optax

    grads = {"a": np.full((3,), 4.0, np.float32), "b": np.full((2, 2), 3.0, np.float32)}
    norm = float(np.sqrt(3 * 16 + 4 * 9))
    clipped, reported = optimizer.clip_gradients(grads, 1.0)
    assert float(reported) == pytest.approx(norm)
    assert float(optax.tree.norm(clipped)) == pytest.approx(1.0)
    expected, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), clipped, expected)
    unclipped, _ = optimizer.clip_gradients(grads, 2 * norm)  # under the limit: unchanged
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), unclipped, grads)


def test_fresh_states_saves_and_restores_compile_once(tmp_path):
    # A profile starts many fresh states and a run saves at every checkpoint: the second time
    # round must reuse the programs, not trace and compile them again. Tracing and lowering are
    # counted too, because a compilation cache would hide a program compiled anew.
    setup = build.build(small_configs(tmp_path, "--gin.ParallelConfig.pp=2"))
    setup.staged(setup.canonical(setup.init_state()))
    compiles = []
    events = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")
    listener = lambda name, secs, **kw: name in events and compiles.append(name)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        state = setup.staged(setup.canonical(setup.init_state()))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert jax.tree.structure(state) == jax.tree.structure(setup.abstract_state())


def test_a_rerun_with_nothing_to_do_leaves_config_gin_as_the_checkpointed_run_wrote_it(tmp_path):
    train.run(small_configs(tmp_path, "--gin.TrainConfig.steps=2"), quiet=True)
    written = (tmp_path / "config.gin").read_text()
    assert train.run(small_configs(tmp_path, "--gin.TrainConfig.steps=1"), quiet=True) == {"steps": 2}
    # was rewritten with steps = 1: a rerun then said "TrainConfig.steps 1 -> 2" of a run trained to 2
    assert (tmp_path / "config.gin").read_text() == written


def test_a_warm_up_as_long_as_the_run_is_noted(tmp_path, capsys):
    one = ["--gin.ParallelConfig.dp=1", "--gin.TrainConfig.steps=1", "--gin.CheckpointConfig.enabled=False"]
    train.run(small_configs(tmp_path / "a", *one), jax.devices()[:1])
    train.run(small_configs(tmp_path / "b", *one[:2], "--gin.TrainConfig.steps=2", "--gin.CheckpointConfig.enabled=False"),
              jax.devices()[:1])
    said = capsys.readouterr().out.splitlines()
    assert sum(line.endswith(", gpipe over 1 microbatch on 1 cpu device") for line in said) == 2  # not plurals
    notes = [line for line in said if line.startswith("note: TrainConfig.warmup_steps")]
    assert notes == ["note: TrainConfig.warmup_steps = 1 >= steps = 1: the learning rate rises for the whole run "
                     "and never decays"]


def test_a_resumed_run_keeps_no_copy_of_the_checkpoint_on_the_devices(tmp_path, monkeypatch):
    live = []
    batch = build.Setup.batch
    monkeypatch.setattr(build.Setup, "batch",
                        lambda self, *a: (gc.collect(), live.append(len(jax.live_arrays())), batch(self, *a))[2])
    one = ["--gin.ParallelConfig.dp=1", "--gin.TrainConfig.steps=4", "--gin.CheckpointConfig.every=2"]
    train.run(small_configs(tmp_path / "fresh", *one), jax.devices()[:1], quiet=True)
    fresh = live[-1]
    train.run(small_configs(tmp_path / "resumed", *one, "--gin.TrainConfig.stop_after=2"), jax.devices()[:1], quiet=True)
    live.clear()
    train.run(small_configs(tmp_path / "resumed", *one), jax.devices()[:1], quiet=True)
    assert live[-1] == fresh  # the restored canonical state was held beside the staged one


def test_a_layout_that_cannot_work_is_refused_before_the_data_is_read(tmp_path, monkeypatch):
    """A bad plan used to be reported only after the data was loaded (a large text folder prepared)."""
    read = []
    monkeypatch.setattr(train.data, "load", lambda cfg: read.append(cfg))
    with pytest.raises(ConfigError, match="pp = 3"):
        train.run(small_configs(tmp_path, "--gin.ParallelConfig.pp=3"), devices=jax.devices()[:2], quiet=True)
    assert read == []


def test_a_run_without_checkpoints_on_a_workdir_holding_some_is_refused_before_it_writes(tmp_path):
    # It started from step 1, replaced the checkpointed run's metrics rows and config.gin, and a
    # later run with checkpoints resumed the old run beside the new one's rows.
    train.run(small_configs(tmp_path, "--gin.TrainConfig.steps=4", "--gin.TrainConfig.stop_after=2"),
              devices=jax.devices()[:1], quiet=True)
    metrics, config = (tmp_path / "metrics.jsonl").read_text(), (tmp_path / "config.gin").read_text()
    with pytest.raises(ConfigError, match=r"TrainConfig.workdir = .* holds checkpoints \(the newest at step 2\): "
                                          r"with CheckpointConfig.enabled = False .*; allowed: "):
        train.run(small_configs(tmp_path, "--gin.TrainConfig.steps=4", "--gin.CheckpointConfig.enabled=False",
                                "--gin.TrainConfig.learning_rate=0.03"), devices=jax.devices()[:1], quiet=True)
    assert (tmp_path / "metrics.jsonl").read_text() == metrics and (tmp_path / "config.gin").read_text() == config


def test_init_from_is_checked_before_the_data_where_checkpoints_holds_no_step(tmp_path, monkeypatch):
    """A run killed before its first save leaves checkpoints/ empty: the rerun starts afresh from
    `init_from`, so a wrong folder must be found before a long data prepare, as on a first run."""
    (tmp_path / "checkpoints").mkdir()
    read = []
    monkeypatch.setattr(train.data, "load", lambda cfg: read.append(cfg))
    with pytest.raises(ConfigError, match="ModelConfig.init_from"):
        train.run(small_configs(tmp_path, f"--gin.ModelConfig.init_from={tmp_path / 'no-such-model'}"),
                  devices=jax.devices()[:1], quiet=True)
    assert read == []


def test_the_summarys_tokens_per_second_and_tflops_are_those_of_its_step_time():
    # Each was a median of its own: of two rows, a mean that disagreed with the median step time.
    rows = [{"step": step, "loss": 2.0, "step_time_s": seconds, "tokens_per_s": 512 / seconds,
             "tflops_per_device": 0.002 / seconds} for step, seconds in ((1, 0.5), (2, 0.02), (3, 0.04))]
    summary = train.summarize(train.Rows(0, rows), predicted_step_s=0.01, say=lambda line: None)
    assert summary["step_time_s"] == pytest.approx(0.03)
    assert summary["tokens_per_s"] == pytest.approx(512 / 0.03)
    assert summary["tflops_per_device"] == pytest.approx(0.002 / 0.03)


def test_the_rows_a_run_keeps_for_its_done_line_do_not_grow_with_the_run():
    # Every row was kept until the end: a run logging each of a million steps held about 600 MB.
    import tracemalloc

    def row(step):
        return {"step": step, "loss": 2.0, "grad_norm": 1.0, "skipped": 0, "lr": 1e-3, "step_time_s": 0.01 + step % 7,
                "tokens_per_s": 512.0, "tflops_per_device": 0.01, "mfu": 0.1}
    tracemalloc.start()
    try:
        rows = train.Rows(start=0)
        for step in range(1, 100_001):
            rows.add(row(step))
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 2 * 2**20  # a step time each (800 kB), not the 100,000 rows (about 60 MB)
    assert (rows.first["step"], rows.last["step"], len(rows.step_times)) == (1, 100_000, 99_999)
    summary = train.summarize(rows, predicted_step_s=0.01, say=lambda line: None)
    assert summary["step_time_s"] == np.median([0.01 + step % 7 for step in range(2, 100_001)])


def test_a_row_whose_console_line_finds_no_reader_is_not_counted_again_in_the_next(tmp_path):
    # The loop goes on to the next step after a BrokenPipeError (then stops): that row's steps
    # stayed pending, so the next row counted its skipped step again, and the summary lost it.
    class LeftReader:
        def __init__(self):
            self.rows = []

        def write(self, row):
            self.rows.append(row)  # on disk; then the console's print fails once
            if len(self.rows) == 1:
                raise BrokenPipeError

    setup = build.build(small_configs(tmp_path, "--gin.ParallelConfig.dp=1"), jax.devices()[:1])
    state, log = setup.init_state(), LeftReader()
    logger = train.StepLogger(setup, None, None, log, peak_tflops_per_device=1.0)
    logger.collect({"loss": np.nan, "grad_norm": np.nan, "skipped": True})
    with pytest.raises(BrokenPipeError):
        logger.row(1, state, last=6)
    logger.collect({"loss": 2.0, "grad_norm": 1.0, "skipped": False})
    logger.row(2, state, last=6)
    assert [row["skipped"] for row in log.rows] == [1, 0]
    assert (logger.rows.first["step"], logger.rows.last["step"]) == (1, 2)


def _done_line(start: int) -> str:
    rows = [{"step": step, "loss": loss, "step_time_s": 0.1, "tokens_per_s": 5120.0, "tflops_per_device": 0.01}
            for step, loss in ((start + 1, 3.21), (start + 2, 3.0), (16, 2.8))]
    said = []
    train.summarize(train.Rows(start, rows), predicted_step_s=0.1, say=said.append)
    return said[0]


def test_a_resumed_runs_done_line_says_which_steps_its_losses_are_of():
    # Its first loss is of the first step after the checkpoint: read as step 1's, the run looked
    # as if it had barely learnt.
    assert _done_line(start=8).startswith("done: step 16, loss 3.210 (step 9) -> 2.800 (step 16); ")
    assert _done_line(start=0).startswith("done: step 16, loss 3.210 -> 2.800; ")  # a fresh run's from step 1


def test_config_gin_records_the_cpu_devices_the_launcher_gave(tmp_path, monkeypatch):
    # HOLMES_CPU_DEVICES (launch --devices-per-process) wins over ParallelConfig.cpu_devices: config.gin
    # said 8, and a rerun from it without the launcher trained on 8 devices, dp = 8, not this run's 2.
    monkeypatch.setenv("HOLMES_CPU_DEVICES", "2")
    r = run_module("holmes_jax.train", "--gin.ParallelConfig.pp=1", "--gin.ModelConfig.num_layers=2",
                   "--gin.ModelConfig.hidden=64", "--gin.ModelConfig.num_heads=4", "--gin.ModelConfig.ffn_hidden=128",
                   "--gin.DataConfig.seq_len=32", "--gin.DataConfig.global_batch=16", "--gin.TrainConfig.steps=1",
                   "--gin.TrainConfig.eval_batches=1", "--gin.CheckpointConfig.enabled=False",
                   f"--gin.TrainConfig.workdir={tmp_path}", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "on 2 cpu devices" in r.stdout
    rerun = configure.load_configs(["--no_default_gin", "--gin_file", str(tmp_path / "config.gin")])
    assert rerun.parallel.cpu_devices == 2


def test_a_skipped_steps_line_without_a_reader_stops_the_run_with_that_step_saved(tmp_path, monkeypatch):
    # `train | head` where the first line after the reader left is a skipped step's: the loop stops
    # as at a signal (status 141), the step saved; the error escaped the loop, nothing saved.
    from holmes_jax import cli, guard

    add = guard.BadSteps.add

    def add_then_fail_to_print(self, step, out):
        add(self, step, out)
        if step == 2:
            raise BrokenPipeError

    monkeypatch.setattr(guard.BadSteps, "add", add_then_fail_to_print)
    monkeypatch.setattr(cli, "drop_output", lambda: None)  # not this test process's stdout
    with pytest.raises(cli.Stopped) as stopped:
        train.run(small_configs(tmp_path, "--gin.CheckpointConfig.every=100"), quiet=True)
    assert stopped.value.status == 128 + signal.SIGPIPE and "after step 2" in str(stopped.value)
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [2]


def test_a_process_reads_only_the_batch_rows_its_devices_hold(tmp_path, monkeypatch):
    """Played in one process: `make_array_from_callback` asks only for the shards of the devices
    one process of a multi-host job could hold (data indices 1 and 3 of a dp 4 x tp 2 mesh)."""
    from holmes_jax import data

    setup = build.build(small_configs(tmp_path, "--gin.ParallelConfig.dp=4", "--gin.ParallelConfig.tp=2",
                                      "--gin.ParallelConfig.microbatches=2"), jax.devices())
    tokens = data.load(setup.cfgs.data)
    whole = setup.batch("train", 5, tokens)
    in_order = tokens.batch("train", setup.cfgs.train.seed, 5, 16, 32).reshape(2, 8, 33)  # microbatch-major
    np.testing.assert_array_equal(np.asarray(whole), in_order)
    data_axis = setup.mesh.axis_names.index("data")
    mine = [d for d in setup.mesh.devices.flat
            if np.argwhere(setup.mesh.devices == d)[0][data_axis] in (1, 3)]
    read, shards = [], {}
    real_batch = data.TokenData.batch

    def counting_batch(self, *args, **kwargs):
        out = real_batch(self, *args, **kwargs)
        read.append(len(out))
        return out

    def only_mine(shape, sharding, callback):
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            if device in mine:
                shards[device] = callback(index)
        return whole

    monkeypatch.setattr(data.TokenData, "batch", counting_batch)
    monkeypatch.setattr(build.jax, "make_array_from_callback", only_mine)
    setup.batch("train", 5, tokens)
    assert sum(read) == 16 // 2  # two data shards of 4, each read once for its 2 tensor devices
    assert len(shards) == 4
    indices = whole.sharding.devices_indices_map(whole.shape)
    for device, shard in shards.items():
        np.testing.assert_array_equal(shard, np.asarray(whole)[indices[device]])


@pytest.mark.parametrize("fails_at", [3, 6])
def test_a_console_line_that_cannot_be_written_stops_the_run_saved_with_one_error(tmp_path, monkeypatch, fails_at):
    # stdout on a full disk: train's lines flush at once, so the OSError came from inside the run,
    # a traceback with nothing saved since the last checkpoint (the last step's: the run said done)
    from holmes_jax import cli

    class FullAfterSomeSteps:
        def write(self, text):
            if text.startswith(f"step {fails_at}/"):
                raise OSError(28, "No space left on device")
            return len(text)

        def flush(self):
            pass

    monkeypatch.setattr(cli, "drop_output", lambda: None)  # not this test process's stdout
    monkeypatch.setattr(sys, "stdout", cli._CheckedOutput(FullAfterSomeSteps()))
    with pytest.raises(cli.OutputFailed, match="^cannot write the output: No space left on device") as failed:
        train.run(small_configs(tmp_path, "--gin.CheckpointConfig.every=100"))
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    if fails_at < 6:
        assert f"after step {fails_at + 1}; checkpoint saved at step {fails_at + 1}" in str(failed.value)
        assert saved == [fails_at + 1]
    else:
        assert saved == [6]  # the last step's save, then the error


def test_a_metrics_row_that_cannot_be_written_stops_the_run_saved_with_one_error(tmp_path, monkeypatch):
    # metrics.jsonl on a full disk ended the run at once with nothing saved since the last
    # checkpoint; with several processes, process 0 left and the others waited for it for ever
    from holmes_jax import cli, metrics

    write = metrics.MetricsLog._write_files

    def full_at_step_3(self, row):
        if row["step"] >= 3:
            raise OSError(28, "No space left on device", str(self.path))
        write(self, row)

    monkeypatch.setattr(metrics.MetricsLog, "_write_files", full_at_step_3)
    with pytest.raises(cli.OutputFailed) as failed:
        train.run(small_configs(tmp_path, "--gin.CheckpointConfig.every=100"), quiet=True)
    assert re.fullmatch(r"cannot write .*metrics.jsonl: No space left on device after step 4; checkpoint saved at "
                        r"step 4: run the same command again to resume", str(failed.value)), str(failed.value)
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [4]
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]


def test_a_last_save_that_fails_ends_the_run_with_its_step_and_no_done_line(tmp_path, monkeypatch, capsys):
    # The last step's save is written in the background: the run printed 'done: step 6 ...' and
    # only then 'error: cannot write checkpoints' (a full disk), without naming the step.
    import orbax.checkpoint as ocp

    save, wait, saved, failed_once = ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished, [], []

    def save_started(self, step, *args, **kwargs):
        done = save(self, step, *args, **kwargs)
        saved.append(step)
        return done

    def background_write_fails(self):  # the write of a save already started fails, reported once (as orbax does)
        wait(self)
        if saved and not failed_once:
            failed_once.append(True)
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(ocp.CheckpointManager, "save", save_started)
    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", background_write_fails)
    with pytest.raises(train.cli.RunError) as failed:
        train.run(small_configs(tmp_path, "--gin.TrainConfig.log_every=100"), devices=jax.devices()[:1])
    assert saved == [6] and failed_once
    assert "done:" not in capsys.readouterr().out
    assert re.fullmatch(r"cannot write checkpoints in .* \(saving step 6\): .*No space left on device",
                        str(failed.value))


def test_a_signal_in_the_last_step_does_not_ask_for_a_rerun_that_has_nothing_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("HOLMES_FAULT", "signal:TERM:step:6")
    with pytest.raises(train.cli.Stopped) as stopped:
        train.run(small_configs(tmp_path), devices=jax.devices()[:1], quiet=True)
    assert str(stopped.value) == "stopped by SIGTERM after step 6; checkpoint saved at step 6, the run's last step"
    assert train.run(small_configs(tmp_path), devices=jax.devices()[:1], quiet=True) == {"steps": 6}  # nothing to do


def test_validation_reads_each_loss_before_the_next_batch_goes_out():
    # 150 or more batches in flight at once: XLA's CPU runtime aborted the run on a rendezvous
    # timeout (exit 134), and the step's checkpoint, written after validation, was lost
    events = []

    class Loss:
        def __init__(self, value):
            self.value = value

        def __float__(self):
            events.append(("read", self.value))
            return self.value

    def eval_step(params, batch):
        events.append(("run", batch))
        return Loss(float(batch))

    # what evaluate reads of a Setup: the batch count and the batches (here their numbers)
    setup = SimpleNamespace(cfgs=SimpleNamespace(train=SimpleNamespace(eval_batches=3)),
                            batch=lambda split, i, token_data: i)
    assert train.evaluate(setup, eval_step, None, None) == 1.0
    assert events == [("run", 0), ("read", 0.0), ("run", 1), ("read", 1.0), ("run", 2), ("read", 2.0)]
