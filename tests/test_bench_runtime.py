"""bench/runtime.py's paired ratio: the median of per-round ratios of two variants timed
in the same rounds, with the sign test's distribution-free interval of that median."""
import importlib.util
import os
import random

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "runtime.py")
_SPEC = importlib.util.spec_from_file_location("bench_runtime", _PATH)
bench_runtime = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_runtime)   # by path: bench/ is no package, and its names stay off sys.path
paired_ratio = bench_runtime.paired_ratio


def test_the_paired_ratio_is_the_median_of_per_round_ratios_with_the_sign_test_interval():
    reference = [0.010] * 15
    times = [0.010 * (1 + k / 100) for k in range(15)]  # ratios 1.00 ... 1.14, in any order
    random.Random(0).shuffle(times)
    median, low, high = paired_ratio(times, reference)
    assert median == pytest.approx(1.07)
    # 15 rounds: the 4th and the 12th smallest ratio (P(Binomial(15, 1/2) <= 3) = 1.8% a side)
    assert (low, high) == (pytest.approx(1.03), pytest.approx(1.11))
    # a drift that slows both variants alike in some rounds cancels in each round's ratio
    drift = [1 + 0.5 * (i % 2) for i in range(15)]
    assert paired_ratio([1.02 * d for d in drift], drift) == pytest.approx((1.02, 1.02, 1.02))
    # too few rounds for a 95% interval: the smallest and largest ratio
    assert paired_ratio([1.0, 2.0, 3.0], [1.0, 1.0, 1.0]) == (2.0, 1.0, 3.0)
