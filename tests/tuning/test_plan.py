"""The plan of a fit's memory (pure): the plateau rule, lines per stage, the band, budgets and the table."""

from __future__ import annotations

import pytest

from lightning_gpumem.tuning.search.model import Line, Point
from lightning_gpumem.tuning.search.plan import Plan, Terms, plan_table, probe_verdict

GIB, MIB = 2**30, 2**20


def _probes(curve, sizes, val=None, reserved=None):
    return [
        Point(
            b,
            int(curve(b)),
            None if val is None else int(val(b)),
            None if reserved is None else int(reserved(b)),
        )
        for b in sizes
    ]


def _grow(curve, limit=80 * GIB, upper=4096, start=2, val=None, reserved=None):
    """Probe as the planner does: from `start`, doubling, while the verdict asks for more."""
    sizes = [start]
    while True:
        verdict, nxt = probe_verdict(_probes(curve, sizes, val, reserved), limit, upper)
        if verdict != "more":
            return verdict, sizes
        sizes.append(nxt)


def test_an_affine_curve_settles_after_three_probes_and_predicts_exactly():
    curve = lambda b: 2 * GIB + b * 100 * MIB  # noqa: E731
    verdict, sizes = _grow(curve)
    assert (verdict, sizes) == ("settled", [2, 4, 8])  # the increment 4 -> 8 is 14% of the peak at 8
    plan = Plan(_probes(curve, sizes), verdict)
    assert plan.need(500) == curve(500)
    assert plan.largest_under(24 * GIB) == (24 * GIB - 2 * GIB) // (100 * MIB)
    assert plan.band(500) == pytest.approx(0.01 * curve(500))  # slopes agree: only the floor


def test_a_plateau_keeps_the_probes_growing_until_activations_dominate():
    curve = lambda b: max(6 * GIB, 2 * GIB + b * 50 * MIB)  # noqa: E731  # the optimizer step's temporaries up to 82
    verdict, sizes = _grow(curve)
    assert verdict == "settled"
    assert sizes[-1] >= 256
    assert all(curve(b) == 6 * GIB for b in sizes[:-3])
    plan = Plan(_probes(curve, sizes), verdict)
    assert plan.largest_under(24 * GIB) == (24 * GIB - 2 * GIB) // (50 * MIB)  # the line above the plateau
    two = Plan(_probes(curve, [2, 4]), "settled")  # a line through the plateau predicts nothing bounded
    assert two.largest_under(24 * GIB) is None


def test_probes_stay_under_half_the_limit_and_a_curve_off_the_line_is_not_affine():
    noisy = {2: 3, 4: 5, 8: 6, 16: 13, 32: 18, 64: 40}
    verdict, sizes = _grow(lambda b: noisy[b] * GIB, limit=100 * GIB)
    assert verdict == "not_affine"
    assert max(noisy[b] for b in sizes) <= 50  # no probe's line predicted more than half the limit
    assert probe_verdict(_probes(lambda b: noisy[b] * GIB, [2, 4, 8, 16, 32]), 100 * GIB, 4096)[0] == "more"


def test_a_peak_that_barely_moves_is_affine_where_the_ceiling_or_upper_stops_the_probes():
    curve = lambda b: 10 * GIB + b * MIB  # noqa: E731  # the increments never reach 10% of the peak
    verdict, sizes = _grow(curve, upper=64)
    assert (verdict, sizes[-1]) == ("settled", 64)
    plan = Plan(_probes(curve, sizes), verdict)
    assert plan.largest_under(12 * GIB) == 2048


def test_validation_has_its_own_line_and_the_need_is_the_larger():
    train = lambda b: 4 * GIB + b * 10 * MIB  # noqa: E731
    val = lambda b: 1 * GIB + b * 40 * MIB  # noqa: E731  # longer sequences in validation
    verdict, sizes = _grow(train, val=val)
    plan = Plan(_probes(train, sizes, val=val), verdict)
    assert len(plan.lines) == 2
    assert plan.per_sample == 40 * MIB
    assert plan.largest_under(24 * GIB) == (23 * GIB) // (40 * MIB)  # validation bounds it


def test_reserved_growing_faster_than_live_tensors_lowers_the_prediction():
    live = lambda b: 2 * GIB + b * 100 * MIB  # noqa: E731
    reserved = lambda b: 2.5 * GIB + b * 110 * MIB  # noqa: E731
    verdict, sizes = _grow(live, reserved=reserved)
    plan = Plan(_probes(live, sizes, reserved=reserved), verdict)
    assert plan.growth == pytest.approx(1.1)
    assert plan.largest_under(24 * GIB) == int((24 * GIB - 2.5 * GIB) // (110 * MIB))
    assert plan.largest_under(24 * GIB, live_only=True) == (22 * GIB) // (100 * MIB)


def test_budgets_count_the_memory_outside_pytorch_and_say_whether_the_size_fits():
    curve = lambda b: 2 * GIB + b * 100 * MIB  # noqa: E731
    plan = Plan(_probes(curve, [8, 16, 32]), "settled", outside=GIB, terms=Terms(outside=GIB))
    fits, tight = plan.predict(100, 24 * GIB), plan.predict(100, 12 * GIB)
    assert fits.limit == 23 * GIB
    assert fits.fits
    assert fits.largest == (21 * GIB) // (100 * MIB)
    assert not tight.fits
    assert tight.largest == (9 * GIB) // (100 * MIB)
    assert fits.peak == curve(100)
    table = plan_table(plan, 100, [fits, tight])
    assert "| 24.0 | 23.00 |" in table
    assert "| no |" in table
    assert "outside PyTorch" in table
    assert Plan(_probes(curve, [8, 16, 32]), "not_affine").predict(100, 24 * GIB).largest is None


def test_the_band_widens_with_the_distance_from_the_probes_by_the_slopes_disagreement():
    points = [Point(8, 10 * GIB), Point(16, 11 * GIB), Point(32, int(13.06 * GIB))]  # 3% apart
    plan = Plan(points, "settled")
    near, far = plan.band(32), plan.band(320)
    assert near == pytest.approx(0.01 * plan.reserved(32))
    assert far - 0.01 * plan.reserved(320) == pytest.approx(abs(2.06 / 16 - 1 / 8) * GIB * (320 - 32))


def test_lines_and_bad_input():
    assert Line.through((4, 10.0), (2, 12.0)).slope == 0  # falling: flat, not negative
    assert Line(5.0, 0.0).largest_under(4.0) == 0
    assert Line(5.0, 0.0).largest_under(6.0) is None
    with pytest.raises(ValueError, match="at least 2"):
        Plan([Point(2, GIB)], "settled")
    with pytest.raises(ValueError, match="empty"):
        probe_verdict([], GIB, 10)


# ---------------------------------------------------------------------- any set of points: a plan or a named refusal
def _random_points(rng, count):
    sizes = [rng.choice([1, 2, 3, 4, 8, 8, 16, 64, 2**20]) for _ in range(count)]
    with_val = rng.random() < 0.5
    with_reserved = rng.random() < 0.5
    points = []
    for b in sizes:
        train = rng.choice([0, rng.randrange(0, 2**40), int(b * rng.random() * 2**24), 2**62])
        val = rng.randrange(0, 2**36) if with_val or rng.random() < 0.1 else None
        reserved = train + rng.randrange(0, 2**30) if with_reserved else None
        points.append(Point(b, train, val, reserved))
    return points


def test_any_set_of_points_with_repeated_sizes_gives_a_plan_or_a_named_refusal():
    import random

    rng = random.Random(0)
    for _ in range(3000):
        points = _random_points(rng, rng.randrange(1, 7))
        for verdict in ("settled", "not_affine"):
            if len({p.size for p in points}) < 2:  # one size: no line, refused by name
                with pytest.raises(ValueError, match="`probes`"):
                    Plan(list(points), verdict)
                continue
            plan = Plan(list(points), verdict)
            assert [p.size for p in plan.probes] == sorted({p.size for p in points})
            for budget in (0, 1, 2**20, 24 * GIB, 2**62):
                prediction = plan.predict(rng.choice([1, 7, 4096]), budget)
                largest = plan.largest_under(prediction.limit)
                if largest:  # the size it gives fits the limit
                    assert plan.reserved(largest) <= prediction.limit
            plan_table(plan, 8, [plan.predict(8, 24 * GIB)])
        verdict, _ = probe_verdict(list(points), rng.choice([None, 24 * GIB]), 4096)
        assert verdict in ("settled", "more", "not_affine")


def test_two_budgets_that_validate_one_size_give_one_point_of_that_size():
    probes = [Point(2, 3 * GIB), Point(4, 4 * GIB), Point(8, 6 * GIB)]
    validated = [Point(100, 52 * GIB, None, 53 * GIB), Point(100, 51 * GIB, None, 54 * GIB)]
    plan = Plan([*probes, *validated], "settled")  # was: ZeroDivisionError
    assert [p.size for p in plan.probes] == [2, 4, 8, 100]
    assert plan.last == Point(100, 52 * GIB, None, 54 * GIB)  # the larger of each peak
    assert plan.largest_under(80 * GIB) >= 100


@pytest.mark.parametrize("point", [Point(0, GIB), Point(-2, GIB), Point(2, -1), Point(2, GIB, None, -5)])
def test_a_nonsense_point_is_refused_naming_probes(point):
    with pytest.raises(ValueError, match="`probes` holds Point"):
        Plan([Point(1, GIB), Point(4, 2 * GIB), point], "settled")


def test_a_plan_of_one_size_is_refused_naming_probes():
    with pytest.raises(ValueError, match="`probes` has 1 batch size"):
        Plan([Point(8, GIB), Point(8, 2 * GIB)], "settled")
