import math

import pytest
import sympy

from cost_models import (ALGORITHMS, COLLECTIVES, SYMBOLS, ceil_log2, cheapest_algorithm,
                         collective_expr, collective_time)
from ddlc.mesh import LinkModel

A, BW = 1e-5, 1e9          # α = 10 us, 1 GB/s
LINK = LinkModel(A, BW)
N = 2**20
BETA = 1 / BW


@pytest.mark.parametrize("kind, algorithm, p, expected", [
    ("all_gather", "ring", 4, 3 * A + 0.75 * N * BETA),
    ("reduce_scatter", "ring", 4, 3 * A + 0.75 * N * BETA),
    ("all_reduce", "ring", 4, 6 * A + 1.5 * N * BETA),
    ("all_to_all", "ring", 4, 3 * A + 3 / 16 * N * BETA),
    ("broadcast", "ring", 4, 3 * A + N * BETA),
    ("all_gather", "tree", 4, 2 * A + 0.75 * N * BETA),
    ("all_gather", "tree", 5, 3 * A + 0.8 * N * BETA),
    ("reduce_scatter", "tree", 8, 3 * A + 7 / 8 * N * BETA),
    ("all_reduce", "tree", 8, 6 * A + 1.75 * N * BETA),
    ("all_to_all", "tree", 8, 3 * A + 3 * N / 16 * BETA),
    ("broadcast", "tree", 5, 3 * (A + N * BETA)),
])
def test_formulas_against_hand_numbers(kind, algorithm, p, expected):
    assert collective_time(kind, N, p, LINK, algorithm) == pytest.approx(expected, rel=1e-12)


def test_ring_all_gather_example_from_the_brief():
    assert collective_time("all_gather", N, 4, LINK, "ring") == pytest.approx(3e-5 + 0.75 * N / 1e9)


@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("algorithm", [*ALGORITHMS, "auto"])
def test_group_of_one_costs_nothing(kind, algorithm):
    assert collective_time(kind, N, 1, LINK, algorithm) == 0.0


@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("algorithm", [*ALGORITHMS, "auto"])
def test_a_links_overhead_is_added_once_to_every_collective_on_more_than_one_device(kind, algorithm):
    slow = LinkModel(A, BW, overhead=3e-3)
    for p in (2, 4, 8):
        assert collective_time(kind, N, p, slow, algorithm) == pytest.approx(
            collective_time(kind, N, p, LINK, algorithm) + 3e-3, rel=1e-12)
    assert collective_time(kind, N, 1, slow, algorithm) == 0.0


@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("p", [2, 3, 4, 7, 8, 64])
@pytest.mark.parametrize("nbytes", [1.0, 4096.0, 2.0**30])
def test_auto_is_the_cheaper_form(kind, p, nbytes):
    times = {a: collective_time(kind, nbytes, p, LINK, a) for a in ALGORITHMS}
    assert collective_time(kind, nbytes, p, LINK) == min(times.values())
    algo, seconds = cheapest_algorithm(kind, nbytes, p, LINK)
    assert seconds == times[algo] == min(times.values())


def test_auto_switches_with_message_size():
    assert cheapest_algorithm("broadcast", 8, 8, LINK)[0] == "tree"
    assert cheapest_algorithm("broadcast", 2**30, 8, LINK)[0] == "ring"
    assert cheapest_algorithm("all_to_all", 8, 16, LINK)[0] == "tree"
    assert cheapest_algorithm("all_to_all", 2**30, 16, LINK)[0] == "ring"


@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_numeric_evaluator_matches_the_symbolic_formula(kind, algorithm):
    expr = collective_expr(kind, algorithm)
    assert expr.free_symbols <= set(SYMBOLS)
    for p in (2, 3, 5, 8, 9, 1024):
        exact = expr.subs(dict(zip(SYMBOLS, (sympy.Integer(N), p, sympy.Rational(1, 10**5),
                                             sympy.Rational(1, 10**9)))))
        assert collective_time(kind, N, p, LINK, algorithm) == pytest.approx(float(exact), rel=1e-12)


def test_ceil_log2_is_exact():
    assert [ceil_log2(sympy.Integer(q)) for q in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
    for k in range(1, 31):  # no floating-point log: 2**k gives exactly k start-ups
        assert collective_time("all_gather", 0, 2**k, LINK, "tree") == pytest.approx(k * A, rel=1e-12)
    assert "ceil_log2(p)" in str(collective_expr("all_reduce", "tree"))


def test_unknown_collective_or_algorithm_is_named():
    with pytest.raises(ValueError, match="all_gather"):
        collective_time("allgather", N, 4, LINK)
    with pytest.raises(ValueError, match="ring"):
        collective_expr("all_gather", "butterfly")


def test_time_grows_with_bytes():
    for kind in COLLECTIVES:
        times = [collective_time(kind, n, 8, LINK) for n in (0, 1e3, 1e6, 1e9)]
        assert times == sorted(times) and not math.isclose(times[0], times[-1])
