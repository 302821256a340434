"""The advisor's choice among measured trials (sim/advisor.py), without clusters."""
from pdserve.sim.advisor import Trial, ratios, recommend


def trial(p, d, goodput, good_share, p99_ttft=100.0):
    return Trial(p, d, 100, 0, 10.0, goodput, good_share, 50.0, p99_ttft, 20.0, 0.0)


def test_ratios_are_every_split_of_each_count():
    assert ratios([2, 4]) == [(1, 1), (1, 3), (2, 2), (3, 1)]


def test_fewest_nodes_that_meet_the_target_then_most_goodput():
    trials = [trial(1, 1, 3.0, 0.50), trial(1, 2, 5.0, 0.96), trial(2, 1, 5.5, 0.97),
              trial(2, 2, 6.0, 1.0), trial(3, 1, 6.1, 1.0)]
    best, met = recommend(trials, 0.95)
    assert (best.prefill, best.decode, met) == (2, 1, True)


def test_equal_goodput_prefers_the_lower_tail():
    best, _ = recommend([trial(1, 2, 5.0, 1.0, 400.0), trial(2, 1, 5.0, 1.0, 200.0)], 0.9)
    assert (best.prefill, best.decode) == (2, 1)


def test_none_enough_gives_the_most_goodput_and_says_so():
    best, met = recommend([trial(1, 1, 1.0, 0.2), trial(2, 2, 2.0, 0.4),
                           trial(1, 3, 1.5, 0.3)], 0.95)
    assert (best.prefill, best.decode, met) == (2, 2, False)
