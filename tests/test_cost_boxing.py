import itertools
import math

import pytest
from hypothesis import given, settings, strategies as st

from conftest import GLOO_ALONE
from cost_models import STEP_KINDS, boxing_cost, boxing_seconds, collective_expr, collective_time
from ddlc.errors import SBPError
from ddlc.mesh import LinkModel, Mesh
from ddlc.sbp import B, P, S, NdSBP, parse_sbp

LINK = LinkModel(1e-5, 1e9)
SLOW, FAST = LinkModel(2e-5, 4e10), LinkModel(1e-5, 3.6e11)


def mesh(*shape, links=None, profile="dgx-h100-ib"):
    """A mesh whose backend runs every collective natively (NCCL), with test links."""
    return Mesh(shape, links=links or (LINK,) * len(shape), profile=profile)


def cost(shape, src, dst, m, **kw):
    return boxing_cost(shape, 4, parse_sbp(src), parse_sbp(dst), m, **kw)


def ring(kind, nbytes, p, link=LINK):
    return collective_time(kind, nbytes, p, link, "ring")


# -- one axis -------------------------------------------------------------------
N = 8 * 16 * 4  # a float32 (8, 16) tensor


@pytest.mark.parametrize("src, dst, kind", [
    ("S0", "B", "all_gather"), ("P", "S1", "reduce_scatter"), ("P", "B", "all_reduce"),
    ("S0", "S1", "all_to_all"), ("B", "S0", "slice"), ("B", "P", "zero"),
])
def test_each_one_axis_transition_is_one_step_priced_by_hand(src, dst, kind):
    plan = cost((8, 16), src, dst, mesh(4))
    (step,) = plan.steps
    assert (step.axis, step.kind, step.nbytes) == (0, kind, N)
    expected = {"all_gather": 3e-5 + 3 / 4 * N / 1e9, "reduce_scatter": 3e-5 + 3 / 4 * N / 1e9,
                "all_reduce": 6e-5 + 6 / 4 * N / 1e9, "all_to_all": 3e-5 + 3 / 16 * N / 1e9,
                "slice": 0.0, "zero": 0.0}[kind]
    assert plan.seconds == step.seconds == pytest.approx(expected, rel=1e-12)


def test_an_emulated_collective_is_priced_as_what_the_backend_runs():
    """Gloo runs a reduce-scatter as an all-reduce (keeping its chunk): cpu-gloo says so."""
    plan = cost((8, 16), "P", "S1", mesh(4, profile=GLOO_ALONE))
    (step,) = plan.steps
    assert (step.kind, step.runs_as) == ("reduce_scatter", "all_reduce")
    assert plan.seconds == pytest.approx(ring("all_reduce", N, 4), rel=1e-12)
    assert "reduce_scatter[ring] as all_reduce" in str(step)
    assert step.formula == collective_expr("all_reduce", "ring")


@pytest.mark.parametrize("kind", ["all_gather", "all_to_all", "all_reduce"])
def test_a_measured_collective_runs_on_its_own_fit(kind):
    """cpu-gloo holds each collective's measured ring fit as factors on the all-reduce's
    link: a kind is priced with its start-up and bandwidth scaled so (the all-reduce, which
    the link holds, as it is)."""
    from cost_models.collectives import axis_time
    m = mesh(4, profile=GLOO_ALONE)
    link = m.links[0]
    latency, bandwidth = dict(m.profile.collective_factors).get(kind, (1.0, 1.0))
    scaled = LinkModel(link.latency * latency, link.bandwidth * bandwidth)
    assert axis_time(kind, N, m, 0) == pytest.approx(ring(kind, N, 4, scaled), rel=1e-12)
    if kind != "all_reduce":  # a fit of its own, not the all-reduce's link
        assert (latency, bandwidth) != (1.0, 1.0)
        assert axis_time(kind, N, m, 0) != pytest.approx(ring(kind, N, 4), rel=1e-3)


def test_no_change_costs_nothing():
    plan = cost((8, 16), "S0", "S0", mesh(4))
    assert plan.steps == () and plan.seconds == 0.0


def test_split_to_partial_is_refused_unless_allowed():
    m = mesh(4)
    refused = cost((8, 16), "S0", "P", m)
    assert refused.seconds == math.inf and not refused.feasible and refused.steps == ()
    allowed = cost((8, 16), "S0", "P", m, allow_split_to_partial=True)
    assert [s.kind for s in allowed.steps] == ["all_gather", "zero"]
    assert allowed.seconds == pytest.approx(ring("all_gather", N, 4))
    assert cost((8, 16, 2), "S0, S1", "B, P", mesh(2, 2)).seconds == math.inf


def test_algorithm_choice_reaches_the_collectives():
    m = mesh(8)
    assert cost((64, 64), "S0", "B", m, algorithm="tree").seconds == pytest.approx(
        collective_time("all_gather", 64 * 64 * 4, 8, LINK, "tree"))
    assert cost((64, 64), "S0", "B", m).steps[0].algorithm == "ring"
    assert cost((64, 64), "S0", "B", m, algorithm="tree").steps[0].formula == collective_expr(
        "all_gather", "tree")
    assert cost((64, 64), "B", "S0", m).steps[0].formula == 0


# -- several axes ---------------------------------------------------------------
def test_bytes_are_those_after_the_other_axes_splits():
    (step,) = cost((8, 16), "S1, S0", "S1, B", mesh(2, 4)).steps
    assert step.nbytes == N // 2
    assert step.seconds == pytest.approx(ring("all_gather", N // 2, 4))


def test_picks_the_cheaper_order():
    # slice on axis 1 first, then all-reduce a quarter of the bytes on axis 0
    plan = cost((64, 64), "P, B", "B, S0", mesh(2, 4))
    assert [(s.axis, s.kind) for s in plan.steps] == [(1, "slice"), (0, "all_reduce")]
    assert plan.seconds == pytest.approx(ring("all_reduce", 64 * 64, 2))
    # the other order is dearer
    assert plan.seconds < ring("all_reduce", 64 * 64 * 4, 2)


def test_hierarchical_detour_beats_the_direct_step():
    # all-reduce over a slow outer axis: slice on the fast inner axis, reduce 1/4, gather back
    m = mesh(2, 4, links=(SLOW, FAST))
    n = 1024 * 1024 * 4
    plan = cost((1024, 1024), "P, B", "B, B", m)
    assert [(s.axis, s.kind) for s in plan.steps] == [(1, "slice"), (0, "all_reduce"),
                                                      (1, "all_gather")]
    assert plan.seconds == pytest.approx(ring("all_reduce", n / 4, 2, SLOW)
                                         + ring("all_gather", n, 4, FAST))
    assert plan.seconds < ring("all_reduce", n, 2, SLOW)


def test_swapped_splits_need_a_detour():
    # (S0, S1) -> (S1, S0): neither direct order is executable
    plan = cost((8, 8), "S0, S1", "S1, S0", mesh(2, 2))
    check_plan(plan)
    assert plan.feasible and len(plan.steps) == 3


def test_nested_split_gathers_inner_axis_first():
    plan = cost((8, 8), "S0, S0", "B, B", mesh(2, 2))
    check_plan(plan)
    assert plan.steps[0].axis == 1


def test_plans_are_cached_and_printable():
    m = mesh(2, 4)
    a, b = cost((64, 64), "P, B", "B, S0", m), cost((64, 64), "P, B", "B, S0", m)
    assert a is b
    assert boxing_seconds((64, 64), 4, parse_sbp("P, B"), parse_sbp("B, S0"), m) == a.seconds
    text = str(a)
    assert "all_reduce[ring]" in text and "(P, S0) -> (B, S0)" in text


def test_mismatched_sbp_is_an_sbp_error():
    with pytest.raises(SBPError):
        cost((8, 8), "S0", "B", mesh(2, 2))
    with pytest.raises(SBPError):
        cost((8, 8), "S2", "B", mesh(2))


# -- properties -----------------------------------------------------------------
def check_plan(plan):
    """The steps chain src -> dst, each is a STEP_KINDS change on one axis, executable, and summed."""
    state = plan.src
    for s in plan.steps:
        assert s.before == state and s.src_sbp == state[s.axis]
        assert s.after == state.replace(s.axis, s.dst_sbp)
        letters = tuple("BPS"[x.kind] for x in (s.src_sbp, s.dst_sbp))
        assert STEP_KINDS[letters] == s.kind and s.src_sbp != s.dst_sbp
        dims = {x.dim for x in (s.src_sbp, s.dst_sbp) if x.is_split}
        assert not any(x.is_split and x.dim in dims for x in state.per_axis[s.axis + 1:])
        state = s.after
    assert state == plan.dst
    assert plan.seconds == pytest.approx(sum(s.seconds for s in plan.steps), rel=1e-12)


@st.composite
def cases(draw):
    shape = tuple(draw(st.lists(st.integers(1, 12), min_size=1, max_size=3)))
    axes = draw(st.integers(1, 2))
    sizes = draw(st.lists(st.integers(1, 4 if axes == 2 else 8), min_size=axes, max_size=axes))
    links = tuple(LinkModel(draw(st.sampled_from([1e-6, 1e-5, 1e-4])),
                            draw(st.sampled_from([1e8, 1e9, 1e11]))) for _ in range(axes))
    values = [B, P, *map(S, range(len(shape)))]
    sbp = st.tuples(*[st.sampled_from(values)] * axes).map(NdSBP)
    return shape, Mesh(tuple(sizes), links=links), draw(sbp), draw(sbp), draw(sbp)


def splits_to_partial(src, dst):
    return any(a.is_split and b.is_partial for a, b in zip(src, dst))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(cases(), st.booleans())
def test_triangle_inequality_and_valid_plans(case, allow):
    """cost(src -> dst) <= cost(src -> mid) + cost(mid -> dst), and every plan is executable.

    Excluded: with ``allow_split_to_partial=False`` a direct change that turns S into P on
    some axis is refused outright (inf), while src -> mid (S -> B) and mid -> dst (B -> P)
    may each be allowed: the refusal is a policy on the change, not a price.
    The tolerance covers the 1e-12 s per step the search adds to prefer fewer steps.
    """
    shape, m, src, mid, dst = case
    direct = boxing_cost(shape, 4, src, dst, m, allow)
    first, second = boxing_cost(shape, 4, src, mid, m, allow), boxing_cost(shape, 4, mid, dst, m, allow)
    for plan in (direct, first, second):
        if plan.feasible:
            check_plan(plan)
    if allow or not splits_to_partial(src, dst):
        assert direct.seconds <= first.seconds + second.seconds + 1e-9


@settings(max_examples=100, deadline=None, derandomize=True)
@given(cases())
def test_never_worse_than_any_order_of_direct_steps(case):
    """The plan costs at most the sum of one-axis boxings in any order of the mesh axes."""
    shape, m, src, _, dst = case
    best = boxing_seconds(shape, 4, src, dst, m, True)
    for order in itertools.permutations(range(m.ndim)):
        state, total = src, 0.0
        for axis in order:
            total += boxing_seconds(shape, 4, state, state.replace(axis, dst[axis]), m, True)
            state = state.replace(axis, dst[axis])
        assert best <= total + 1e-9


def test_three_axis_mesh_and_scalars():
    plan = cost((8, 8, 8, 8), "S0, S1, S2", "S3, S2, S1", mesh(2, 2, 2))
    check_plan(plan)
    assert plan.feasible
    (step,) = cost((), "P", "B", mesh(4)).steps
    assert (step.kind, step.nbytes) == ("all_reduce", 4)
