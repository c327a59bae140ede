"""The learning-rate schedule: the learning rate each update uses, counted from step 1, by
`TrainConfig.lr_schedule` (cosine, wsd, constant), and what a run's metrics rows report."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from holmes_jax import configure, optimizer, train
from holmes_jax.config import ConfigError, TrainConfig
from helpers import read_metrics, small_configs

LR, RATIO = 2e-3, 0.1
FLOOR = LR * RATIO  # as the schedule computes it


def learning_rates_used(tcfg: TrainConfig, updates: int) -> list[float]:
    """The learning rate of each of `updates` updates, read off the optimizer itself: with zero
    gradients AdamW's update of a decayed weight of 1 is -learning_rate * weight_decay."""
    tx, _ = optimizer.make_optimizer(tcfg)
    params = {"kernel": jnp.ones(())}
    update = jax.jit(lambda state: tx.update({"kernel": jnp.zeros(())}, state, params))
    state, used = tx.init(params), []
    for _ in range(updates):
        u, state = update(state)
        used.append(-float(u["kernel"]) / tcfg.weight_decay)
    return used


def config(steps, warmup, schedule="cosine", **fields) -> TrainConfig:
    return TrainConfig(steps=steps, warmup_steps=warmup, learning_rate=LR, min_lr_ratio=RATIO,
                       lr_schedule=schedule, weight_decay=0.5, **fields)


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
@pytest.mark.parametrize("steps, warmup", [(10, 3), (10, 0), (10, 1), (2, 1), (1, 0), (5, 5), (4, 9)])
def test_step_one_warms_up_step_warmup_is_the_peak_and_the_last_step_is_the_floor(schedule, steps, warmup):
    used = dict(enumerate(learning_rates_used(config(steps, warmup, schedule), steps), start=1))
    ramp = max(warmup, 1)  # warm-up 0 starts at the peak, as 1 does
    assert used[1] == pytest.approx(LR / ramp, rel=1e-6)  # the first update moves the weights
    if warmup <= steps:
        assert used[ramp] == pytest.approx(LR, rel=1e-6)
    if ramp >= steps:  # the warm-up fills the run: it rises to its end, nothing decays
        assert used[steps] == pytest.approx(LR * steps / ramp, rel=1e-6)
    elif schedule == "constant":
        assert used[steps] == pytest.approx(LR, rel=1e-6)
    else:
        assert used[steps] == np.float32(FLOOR)  # exactly the floor, not one update short of it


def test_the_schedule_function_is_what_the_updates_use():
    # metrics.jsonl reports schedule(count - 1) after an update: the lr of the update just made
    tcfg = config(12, 4)
    _, schedule = optimizer.make_optimizer(tcfg)
    np.testing.assert_allclose(learning_rates_used(tcfg, 14), [float(schedule(k)) for k in range(14)], rtol=1e-6)


def test_cosine_is_halfway_down_halfway_through_its_decay_and_holds_the_floor_after_the_run():
    _, schedule = optimizer.make_optimizer(config(24, 4))
    lr = lambda step: float(schedule(step - 1))  # noqa: E731
    assert lr(14) == pytest.approx((LR + FLOOR) / 2, rel=1e-6)
    assert lr(5) < LR and lr(23) > FLOOR
    assert lr(25) == lr(100) == np.float32(FLOOR)


def test_wsd_holds_the_peak_then_decays_linearly_over_its_last_fraction():
    _, schedule = optimizer.make_optimizer(config(20, 2, "wsd", decay_fraction=0.25))  # steps 16-20 decay
    lr = lambda step: float(schedule(step - 1))  # noqa: E731
    assert lr(1) == pytest.approx(LR / 2, rel=1e-6)
    assert all(lr(step) == np.float32(LR) for step in range(2, 16))
    for step in range(16, 21):
        assert lr(step) == pytest.approx(LR - (LR - FLOOR) * (step - 15) / 5, rel=1e-6), step
    assert lr(20) == lr(30) == np.float32(FLOOR)


def test_wsd_extended_keeps_every_step_before_its_decay():
    # what a run resumed with more steps relies on: the checkpointed updates' learning rates are the longer run's
    _, short = optimizer.make_optimizer(config(100, 10, "wsd"))
    _, longer = optimizer.make_optimizer(config(300, 10, "wsd"))
    counts = np.arange(80)
    np.testing.assert_array_equal(short(counts), longer(counts))
    assert float(short(99)) == np.float32(FLOOR) and float(longer(99)) == np.float32(LR)


def test_wsd_decays_from_the_warm_ups_end_where_its_fraction_would_start_sooner():
    _, schedule = optimizer.make_optimizer(config(10, 8, "wsd", decay_fraction=0.5))
    assert float(schedule(7)) == np.float32(LR) and float(schedule(8)) < LR and float(schedule(9)) == np.float32(FLOOR)


def test_constant_stays_at_the_peak_after_the_warm_up():
    _, schedule = optimizer.make_optimizer(config(10, 3, "constant"))
    np.testing.assert_array_equal(schedule(np.arange(2, 20)), np.float32(LR))


@pytest.mark.parametrize("binding, field", [
    ("TrainConfig.lr_schedule='linear'", "TrainConfig.lr_schedule"),
    ("TrainConfig.lr_schedule=1", "TrainConfig.lr_schedule"),
    ("TrainConfig.decay_fraction=0", "TrainConfig.decay_fraction"),  # the last step could not reach the floor
    ("TrainConfig.decay_fraction=1.5", "TrainConfig.decay_fraction"),
    ("TrainConfig.decay_fraction=-0.2", "TrainConfig.decay_fraction"),
    ("TrainConfig.decay_fraction=True", "TrainConfig.decay_fraction"),
    ("TrainConfig.decay_fraction=1e999", "TrainConfig.decay_fraction"),
    ("TrainConfig.decay_fraction='0.2'", "TrainConfig.decay_fraction"),
])
def test_bad_schedule_settings_are_config_errors_naming_the_field(binding, field):
    with pytest.raises(ConfigError, match=f"^{field} = .* (allowed|must)"):
        configure.load_configs(["--gin.ParallelConfig.pp=1", f"--gin.{binding}"])


def test_a_run_logs_each_steps_learning_rate_and_its_config_gin_shows_the_schedule(tmp_path):
    # steps 1 and 3 were logged at 0 and above the floor (optax counts from 0; the decay ended one update late)
    cfgs = small_configs(tmp_path, "--gin.TrainConfig.steps=3", "--gin.TrainConfig.warmup_steps=2",
                         f"--gin.TrainConfig.learning_rate={LR}", f"--gin.TrainConfig.min_lr_ratio={RATIO}",
                         "--gin.CheckpointConfig.enabled=False")
    train.run(cfgs, devices=jax.devices()[:1], quiet=True)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["lr"] for r in rows] == pytest.approx([LR / 2, LR, FLOOR], rel=1e-6)
    saved = (tmp_path / "config.gin").read_text()
    assert "TrainConfig.lr_schedule = 'cosine'" in saved and "TrainConfig.decay_fraction = 0.2" in saved


def test_gin_binds_the_schedule_as_the_shell_passes_it(tmp_path):
    # --gin.TrainConfig.lr_schedule='"wsd"' in a shell reaches us as this argument
    cfgs = configure.load_configs(['--gin.TrainConfig.lr_schedule="wsd"', "--gin.TrainConfig.decay_fraction=0.5"])
    assert (cfgs.train.lr_schedule, cfgs.train.decay_fraction) == ("wsd", 0.5)
    gin_file = tmp_path / "wsd.gin"
    gin_file.write_text("TrainConfig.lr_schedule = 'constant'\n")
    assert configure.load_configs(["--gin_file", str(gin_file)]).train.lr_schedule == "constant"
