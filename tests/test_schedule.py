import numpy as np
import pytest

from holmes_jax.planning import schedule


def _check_dependencies(t: schedule.Table):
    p, m = t.stages, t.microbatches
    when = lambda table, s, i: int(np.argwhere(table[:, s] == i)[0, 0])  # noqa: E731
    for s in range(p):
        assert sorted(t.fwd[:, s][t.fwd[:, s] >= 0]) == list(range(m))  # every microbatch once
        assert sorted(t.bwd[:, s][t.bwd[:, s] >= 0]) == list(range(m))
        for i in range(m):
            assert when(t.fwd, s, i) <= when(t.bwd, s, i)
            if s > 0:
                assert when(t.fwd, s - 1, i) < when(t.fwd, s, i)
            if s < p - 1:
                assert when(t.bwd, s + 1, i) < when(t.bwd, s, i)


@pytest.mark.parametrize("name", schedule.SCHEDULES)
@pytest.mark.parametrize("p, m", [(1, 1), (1, 4), (2, 1), (2, 4), (3, 5), (4, 8), (4, 16)])
def test_tables_respect_dependencies(name, p, m):
    _check_dependencies(schedule.build(name, p, m))


@pytest.mark.parametrize("p", [2, 4])
def test_1f1b_holds_at_most_2p_minus_1_activations_and_gpipe_holds_m(p):
    for m in (1, 2, 4, 8, 16, 32):
        one, gpipe = schedule.build("1f1b", p, m), schedule.build("gpipe", p, m)
        assert one.x_slots == min(2 * p - 1, m) == schedule.ring_slots("1f1b", p, m)
        assert gpipe.x_slots == m == schedule.ring_slots("gpipe", p, m)


@pytest.mark.parametrize("p, m", [(2, 4), (2, 16), (3, 5), (4, 8), (4, 32)])
def test_1f1b_runs_a_forward_and_a_backward_on_every_stage_in_every_steady_tick(p, m):
    t = schedule.build("1f1b", p, m)
    assert t.ticks == m + 2 * (p - 1)
    both = (t.fwd >= 0) & (t.bwd >= 0)
    # stage s: F of microbatch t - s and B of t - 2(p - 1) + s, both in ticks 2(p - 1) - s .. m - 1 + s
    for s in range(p):
        busy = np.flatnonzero(both[:, s])
        assert list(busy) == list(range(2 * (p - 1) - s, m + s))


def test_gpipe_takes_the_ideal_number_of_ticks():
    # m + p - 1 forward ticks and as many backward ones, the last stage's first backward sharing a tick.
    for p, m in [(2, 4), (4, 8)]:
        assert schedule.build("gpipe", p, m).ticks == 2 * (m + p - 1) - 1


@pytest.mark.parametrize("name", schedule.SCHEDULES)
def test_transfers_happen_exactly_where_some_arrival_follows(name):
    t = schedule.build(name, 4, 8)
    x_moves, g_moves = schedule.transfers(t.fwd, t.bwd)
    # What moves after tick k arrives at tick k + 1; a tick with nothing arriving sends nothing.
    assert list(x_moves[:-1]) == list((t.x_arrivals()[1:] >= 0).any(axis=1))
    assert list(g_moves[:-1]) == list((t.g_arrivals()[1:] >= 0).any(axis=1))
    assert not x_moves[-1] and not g_moves[-1]
    if name == "gpipe":  # forwards, then backwards: never both in one tick
        assert not (x_moves & g_moves).any()


def _replayed_slots(t: schedule.Table) -> tuple[int, int]:
    """The fewest slots found by replaying every tick: k slots do where no two inputs a stage
    holds in one tick (from arrival to its backward) share microbatch % k."""
    p, m = t.stages, t.microbatches
    when = lambda table, s, i: int(np.argwhere(table[:, s] == i)[0, 0])  # noqa: E731
    x_live, g_live = [], []
    for s in range(p):
        for i in range(m):
            end = when(t.bwd, s, i)
            x_live.append((s, i, when(t.fwd, 0, i) if s == 0 else when(t.fwd, s - 1, i) + 1, end))
            g_live.append((s, i, end if s == p - 1 else when(t.bwd, s + 1, i) + 1, end))

    def fewest(live):
        def fits(k):
            return all(len({i % k for s2, i, a, b in live if s2 == s and a <= tick <= b})
                       == sum(1 for s2, i, a, b in live if s2 == s and a <= tick <= b)
                       for s in range(p) for tick in range(t.ticks))
        return next(k for k in range(1, m + 1) if fits(k))

    return fewest(x_live), fewest(g_live)


@pytest.mark.parametrize("name", schedule.SCHEDULES)
@pytest.mark.parametrize("p, m", [(1, 3), (2, 1), (2, 3), (3, 2), (3, 7), (4, 5), (5, 12)])
def test_slot_counts_are_the_fewest_that_never_overwrite_a_live_input(name, p, m):
    t = schedule.build(name, p, m)
    assert (t.x_slots, t.g_slots) == _replayed_slots(t)


def test_many_microbatches_build_at_once():
    # Gradient accumulation over many microbatches (pp = 1, GPipe by default): the slot count was
    # found by replaying every tick for every candidate, cubic in m: about 9 s at m = 512 and
    # minutes past 1000 before the run started.
    for p, m in [(1, 2048), (2, 1024)]:
        t = schedule.build("gpipe", p, m)
        assert (t.x_slots, t.g_slots) == (m, 1)
    t = schedule.build("1f1b", 8, 1024)
    assert (t.x_slots, t.g_slots) == (15, 1)
