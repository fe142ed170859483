from decimal import Decimal

import pytest

from controlplane.benchmarks.advisor import AT_LEAST, WITHIN, Point, Target, advise


def curve():
    # A reading set: accuracy falls as the cap falls; cost per image falls with it.
    return [
        Point(cap=50_176, accuracy=0.31, low=0.24, high=0.39, items=150, cost_per_image=Decimal("0.000020")),
        Point(cap=200_704, accuracy=0.80, low=0.73, high=0.86, items=150, cost_per_image=Decimal("0.000060")),
        Point(cap=401_408, accuracy=0.93, low=0.88, high=0.96, items=150, cost_per_image=Decimal("0.000110")),
        Point(cap=1_003_520, accuracy=0.94, low=0.89, high=0.97, items=150, cost_per_image=Decimal("0.000260")),
    ]


def test_within_points_of_the_best_picks_the_smallest_cap_close_enough():
    advice = advise(curve(), Target(WITHIN, 2), current_cap=1_003_520)
    assert advice.best.cap == 1_003_520
    assert advice.chosen.cap == 401_408
    assert advice.saving_per_1000 == Decimal("0.150000")
    assert not advice.distinguishable_from_best  # 93 % against 94 %: the set cannot tell them apart
    assert "401,408 px" in advice.summary("USD") and "0.150000 USD per 1,000 images" in advice.summary("USD")


def test_a_looser_target_accepts_a_loss_the_set_can_measure():
    advice = advise(curve(), Target(WITHIN, 15), current_cap=1_003_520)
    assert advice.chosen.cap == 200_704
    assert advice.distinguishable_from_best  # 73–86 % lies below 89–97 %
    assert advice.changes_policy


def test_a_floor_on_the_set_picks_the_smallest_cap_above_it():
    assert advise(curve(), Target(AT_LEAST, 80)).chosen.cap == 200_704
    assert advise(curve(), Target(AT_LEAST, 94)).chosen.cap == 1_003_520


def test_a_floor_no_cap_reaches_is_said_plainly():
    advice = advise(curve(), Target(AT_LEAST, 99), current_cap=1_003_520)
    assert not advice.met and advice.saving_per_1000 is None
    assert advice.summary("USD").startswith("No cap meets at least 99 % on the set")


def test_the_current_cap_already_smallest_changes_nothing():
    advice = advise(curve(), Target(WITHIN, 2), current_cap=401_408)
    assert advice.chosen.cap == 401_408 and not advice.changes_policy
    assert advice.saving_per_1000 == 0


def test_a_current_cap_that_was_not_swept_has_no_saving_figure():
    advice = advise(curve(), Target(WITHIN, 2), current_cap=777_777)
    assert advice.current is None and advice.saving_per_1000 is None
    assert advice.changes_policy


def test_ties_take_the_largest_cap_as_the_best():
    points = [Point(cap=1000, accuracy=1.0, low=0.9, high=1.0, items=30),
              Point(cap=4000, accuracy=1.0, low=0.9, high=1.0, items=30)]
    advice = advise(points, Target(WITHIN, 0))
    assert advice.best.cap == 4000 and advice.chosen.cap == 1000


@pytest.mark.parametrize("kind, points", [("most", 5), (WITHIN, -1), (AT_LEAST, 101)])
def test_a_target_out_of_range_is_refused(kind, points):
    with pytest.raises(ValueError):
        Target(kind, points)


def test_an_empty_curve_is_refused():
    with pytest.raises(ValueError):
        advise([], Target(WITHIN, 1))
