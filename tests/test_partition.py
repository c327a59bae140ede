from pathlib import Path

import numpy as np
import pytest

from holmes_jax.config import ConfigError, ModelConfig, ParallelConfig
from holmes_jax.planning import cost, partition
from holmes_jax.planning import plan

TOPOLOGIES = Path(__file__).resolve().parent.parent / "configs" / "topologies"


def test_uniform_spreads_the_remainder_over_the_first_stages():
    assert partition.uniform(36, 2) == (18, 18)
    assert partition.uniform(37, 2) == (19, 18)
    assert partition.uniform(36, 5) == (8, 7, 7, 7, 7)


def test_holmes_ratio():
    assert partition.ratio_split(48, [26, 22]) == (26, 22)  # the Holmes scripts' IB vs RoCE split
    assert partition.ratio_split(36, [200, 100]) == (24, 12)
    assert partition.ratio_split(4, [1000, 1, 1]) == (2, 1, 1)  # every stage keeps a layer


@pytest.mark.parametrize("ratios", [[1.0, float("inf")], [1.0, float("nan")], [0.0, 1.0]])
def test_holmes_ratio_refuses_ratios_that_are_not_finite_and_positive(ratios):
    # an infinite ratio made every quota nan and the split (0, -9223372036854775808)
    with pytest.raises(ConfigError, match="allowed: finite positive numbers"):
        partition.ratio_split(8, ratios)


def test_holmes_ratio_with_ratios_near_the_float_maximum():
    # their sum overflowed to inf, every quota became 0 and the split was two huge negative counts
    assert partition.ratio_split(10, [1e308, 1e308]) == (5, 5)
    assert partition.ratio_split(36, [1.6e308, 0.8e308]) == (24, 12)
    p = plan(TOPOLOGIES / "ib4_roce4.toml", "tiny", ParallelConfig(tp=4, pp=2, partition="holmes-ratio"),
             ratios={"ib": 1e308, "roce": 1e308})
    assert p.stage_layers == (2, 2)


@pytest.mark.parametrize("call", [
    lambda: partition.uniform(3, 4),
    lambda: partition.ratio_split(2, [1, 1, 1]),
    lambda: partition.balanced(np.ones((5, 4))),
    lambda: partition.auto(lambda s: s.sum(axis=1), 3, 4),
])
def test_fewer_layers_than_stages(call):
    with pytest.raises(ConfigError, match="every pipeline stage needs a layer"):
        call()


def _brute_min_max(costs, extra):
    p, layers = costs.shape
    best = np.inf
    for split in partition.compositions(layers, p):
        stops = np.cumsum(split)
        best = min(best, max(extra[s] + costs[s, stops[s] - split[s]:stops[s]].sum() for s in range(p)))
    return best


def test_balanced_is_the_min_max_split():
    rng = np.random.default_rng(1)
    for case in range(300):
        p = int(rng.integers(1, 5))
        layers = int(rng.integers(p, 11))
        if case % 2:  # stages price layers alike; the embedding and head weigh on the ends
            costs = np.tile(rng.random(layers), (p, 1))
            extra = np.zeros(p)
            extra[0] += rng.random()
            extra[-1] += rng.random()
        else:  # identical layers on stages of different speeds
            costs = np.ones((p, layers)) * rng.random((p, 1))
            extra = rng.random(p)
        split = partition.balanced(costs, extra)
        assert sum(split) == layers and min(split) >= 1
        stops = np.cumsum(split)
        worst = max(extra[s] + costs[s, stops[s] - split[s]:stops[s]].sum() for s in range(p))
        assert worst == pytest.approx(_brute_min_max(costs, extra), rel=1e-9)
    assert partition.balanced(np.ones((3, 10))) == (4, 3, 3)  # evened out among equal maxima


def _hetero(layers, stage_flops, dp_rates, m=6, schedule="1f1b"):
    """A pipeline over clusters of different device speeds and NICs; embedding and head included."""
    layer = cost.Part(params=2e8, fwd_flops=1e12, bwd_flops=2e12)
    work = cost.Work(cost.Part(2e8, 0, 0), (layer,) * layers, cost.Part(1e6, 8e11, 1.6e12), boundary_bytes=5e7)
    stages = [cost.Stage(f, 1, cost.Link(1e11, 2e-6), 4, cost.Link(r, 1e-5)) for f, r in zip(stage_flops, dp_rates)]
    return cost.CostModel(work, stages, [cost.Link(3e9, 5e-5)] * (len(stages) - 1), m, schedule)


CASES = [
    (8, (1e14, 1e14), (2e10, 7e9)),
    (12, (1e14, 6e13, 1e14), (2e10, 7e9, 3e9)),
    (10, (1e14, 1e14, 8e13, 8e13), (2e10, 2e10, 5e9, 5e9)),
    (9, (1e14, 5e13), (2e9, 2e10)),
]


@pytest.mark.parametrize("schedule", cost.SCHEDULES)
@pytest.mark.parametrize("layers, flops, rates", CASES)
def test_auto_equals_exhaustive_search_on_small_cases(layers, flops, rates, schedule):
    model = _hetero(layers, flops, rates, schedule=schedule)
    every = partition.compositions(layers, len(flops))
    best = min(model.predict(split).step_time_s for split in every)  # one by one, no batching
    assert model.predict(partition.split("auto", model)).step_time_s == pytest.approx(best, rel=1e-12)
    # the hill-climbing path used for large cases finds it too
    climbed = partition.split("auto", model, exhaustive_limit=0)
    assert model.predict(climbed).step_time_s == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("layers, flops, rates", CASES)
def test_auto_never_slower_than_the_baselines(layers, flops, rates):
    model = _hetero(layers, flops, rates)
    auto = model.predict(partition.split("auto", model, exhaustive_limit=0)).step_time_s
    paper = (26, 22, 26, 22)[:len(flops)]  # the Holmes scripts' IB:RoCE ratio, repeated
    baselines = [("uniform", None), ("params", None), ("holmes-ratio", rates), ("holmes-ratio", paper)]
    for method, ratios in baselines:
        assert auto <= model.predict(partition.split(method, model, ratios)).step_time_s * (1 + 1e-12)


@pytest.mark.parametrize("topology, parallel", [
    ("ib4_roce4", ParallelConfig(tp=8, pp=2, microbatches=16, schedule="1f1b")),
    ("ib4_roce4", ParallelConfig(tp=8, pp=4, microbatches=16, schedule="1f1b")),
    ("ib3_roce5", ParallelConfig(tp=8, pp=8, microbatches=32, schedule="1f1b")),
    ("three_clusters", ParallelConfig(tp=4, pp=4, microbatches=8, schedule="1f1b")),
])
def test_planned_auto_split_beats_uniform_and_holmes_ratio(topology, parallel):
    p = plan(TOPOLOGIES / f"{topology}.toml", ModelConfig(preset="7.5b", compute_dtype="bfloat16", remat=True),
             parallel, global_batch=512)
    auto = p.partitions["auto"].step_time_s
    assert p.prediction.step_time_s == auto
    for method in ("uniform", "params", "holmes-ratio"):
        assert auto <= p.partitions[method].step_time_s * (1 + 1e-12)


def test_params_counts_embedding_on_first_and_head_on_last():
    model = _hetero(36, (1e14, 1e14), (1e10, 1e10))  # embedding weighs one layer, head nearly nothing
    assert partition.split("params", model) == (18, 18)
    heavy = cost.CostModel(
        cost.Work(cost.Part(4e8, 0, 0), (cost.Part(2e8, 1, 1),) * 36, cost.Part(0, 0, 0), 1.0),
        model.stages, [cost.Link(1e9, 0)], 4)
    assert partition.split("params", heavy) == (17, 19)


def test_explicit_stage_layers_win_and_are_checked():
    model = _hetero(8, (1e14, 1e14), (1e10, 1e10))
    assert partition.split("auto", model, stage_layers=(5, 3)) == (5, 3)
    with pytest.raises(ConfigError, match=r"stage_layers = \[5, 4\] is not allowed; allowed: 2 positive layer counts"):
        partition.split("uniform", model, stage_layers=(5, 4))
    with pytest.raises(ConfigError, match="partition = 'best' is not allowed; choose one of"):
        partition.split("best", model)


def test_plan_tables_round_before_picking_the_unit():
    # 0.9996 s read "1e+03 ms" and 999.6 MB "1e+03 MB" in explain()'s tables
    from holmes_jax.planning.contract import _bytes, format_seconds
    assert [format_seconds(s) for s in (0.9996, 0.0009996, 0.0766, 2.27e-6, 12.6, 0.0)] == \
        ["1 s", "1 ms", "76.6 ms", "2.27 us", "12.6 s", "0 s"]
    assert format_seconds(1234.5) == "1230 s"
    assert [_bytes(n) for n in (999.6e6, 15.7e6, 80e9, 2.5e12)] == ["1 GB", "15.7 MB", "80 GB", "2.5 TB"]


def test_a_plan_prints_its_layout_in_one_short_line():
    # the dataclass's own repr printed the topology, the placement and every partition's
    # prediction: about 6,000 characters for print(plan)
    p = plan(TOPOLOGIES / "ib4_roce4.toml", "tiny", ParallelConfig(tp=4, pp=2))
    text = repr(p)
    assert len(text) < 300 and "\n" not in text and str(p) == text, text
    for part in ("'ib4_roce4'", "'tiny'", "{'stage': 2, 'data': 8, 'tensor': 4}", f"stage_layers={p.stage_layers}",
                 f"schedule='{p.schedule}'", "fits=True"):
        assert part in text, (part, text)
