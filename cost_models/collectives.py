"""α-β times of the collectives on one mesh axis.

Every formula is a sympy expression in ``n`` (bytes of the whole tensor on the
group: the gathered result, the reduced input, the all-to-all's total),
``p`` (group size), ``alpha`` (seconds per message) and ``beta`` (seconds per
byte), so a plan can print why it costs what it costs. The search evaluates
them through functions lambdified once and cached.

Two forms per collective (Thakur, Rabenseifner, Gropp, "Optimization of
collective communication operations in MPICH", IJHPCA 2005; Chan et al.,
"Collective communication: theory, practice, and experience", 2007):

============== ======================================= ==========================================
collective     ring (what NCCL and gloo run)           tree (log-depth)
============== ======================================= ==========================================
all_gather     (p-1)α + (p-1)/p·nβ                     ⌈log2 p⌉α + (p-1)/p·nβ   recursive doubling
reduce_scatter (p-1)α + (p-1)/p·nβ                     ⌈log2 p⌉α + (p-1)/p·nβ   recursive halving
all_reduce     2(p-1)α + 2(p-1)/p·nβ                   2⌈log2 p⌉α + 2(p-1)/p·nβ Rabenseifner
all_to_all     (p-1)α + (p-1)/p²·nβ  pairwise          ⌈log2 p⌉α + ⌈log2 p⌉·n/(2p)·β  Bruck
broadcast      (p-1)α + nβ           pipelined chain   ⌈log2 p⌉(α + nβ)         binomial tree
============== ======================================= ==========================================

In this model the log-depth forms of all_gather, reduce_scatter and
all_reduce are never slower than the rings (same bandwidth term, fewer
start-ups); "auto" makes a real choice for all_to_all and broadcast.
A group of one device costs nothing; on a larger group a link's ``overhead`` (a cost per
call, :class:`ddlc.mesh.LinkModel`) is added to every form.
"""
from __future__ import annotations

import dataclasses
import functools

import sympy

from ddlc.ir import CollectiveInfo
from ddlc.mesh import COLLECTIVE_KINDS, LinkModel, Mesh

__all__ = ["COLLECTIVES", "ALGORITHMS", "SYMBOLS", "ceil_log2", "collective_expr",
           "collective_time", "cheapest_algorithm", "affine_fit", "axis_time", "priced_as", "repriced"]

n, p, alpha, beta = SYMBOLS = sympy.symbols("n p alpha beta", positive=True)


class ceil_log2(sympy.Function):
    """⌈log2 p⌉, exact for integer ``p`` (the depth of a binomial tree over p devices)."""

    @classmethod
    def eval(cls, arg):
        if arg.is_Integer and arg > 0:
            return sympy.Integer(int(arg - 1).bit_length())


_L = ceil_log2(p)

_FORMULAS: dict[tuple[str, str], sympy.Expr] = {
    ("all_gather", "ring"): (p - 1) * alpha + (p - 1) / p * n * beta,
    ("reduce_scatter", "ring"): (p - 1) * alpha + (p - 1) / p * n * beta,
    ("all_reduce", "ring"): 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta,
    ("all_to_all", "ring"): (p - 1) * alpha + (p - 1) / p**2 * n * beta,
    ("broadcast", "ring"): (p - 1) * alpha + n * beta,
    ("all_gather", "tree"): _L * alpha + (p - 1) / p * n * beta,
    ("reduce_scatter", "tree"): _L * alpha + (p - 1) / p * n * beta,
    ("all_reduce", "tree"): 2 * _L * alpha + 2 * (p - 1) / p * n * beta,
    ("all_to_all", "tree"): _L * alpha + _L * n / (2 * p) * beta,
    ("broadcast", "tree"): _L * (alpha + n * beta),
}

COLLECTIVES = COLLECTIVE_KINDS
ALGORITHMS = ("ring", "tree")


def collective_expr(kind: str, algorithm: str = "ring") -> sympy.Expr:
    """The symbolic time of ``kind`` in form ``algorithm`` over :data:`SYMBOLS`."""
    try:
        return _FORMULAS[kind, algorithm]
    except KeyError:
        raise ValueError(f"no formula for collective {kind!r} with algorithm {algorithm!r}; "
                         f"collectives: {', '.join(COLLECTIVES)}; algorithms: "
                         f"{', '.join(ALGORITHMS)}") from None


@functools.cache
def _evaluator(kind: str, algorithm: str):
    """``f(n, p, alpha, beta) -> float``, lambdified once per formula."""
    modules = [{"ceil_log2": lambda q: (int(q) - 1).bit_length()}, "math"]
    return sympy.lambdify(SYMBOLS, collective_expr(kind, algorithm), modules=modules)


def cheapest_algorithm(kind: str, nbytes: float, group_size: int,
                       link: LinkModel) -> tuple[str, float]:
    """The faster of the forms (ring on ties) and its time in seconds."""
    return min(((a, collective_time(kind, nbytes, group_size, link, a)) for a in ALGORITHMS),
               key=lambda item: item[1])


def collective_time(kind: str, nbytes: float, group_size: int, link: LinkModel,
                    algorithm: str = "auto") -> float:
    """Seconds for ``kind`` over ``nbytes`` on ``group_size`` devices joined by ``link``.

    ``algorithm`` is ``"ring"``, ``"tree"`` or ``"auto"`` (the cheaper of the two).
    """
    if algorithm == "auto":
        return cheapest_algorithm(kind, nbytes, group_size, link)[1]
    f = _evaluator(kind, algorithm)
    if group_size <= 1:
        return 0.0
    return float(f(nbytes, group_size, link.latency, link.beta)) + link.overhead


def priced_as(kind: str, mesh: Mesh, axis: int) -> tuple[str, LinkModel]:
    """The collective the backend runs for ``kind`` on mesh ``axis`` and the link it runs
    on, as the profile measured them (``emulated_collectives``: gloo runs a reduce-scatter
    as an all-reduce; ``collective_factors``: that kind's measured fit against the link's)."""
    runs = mesh.profile.runs_as(kind)
    return runs, mesh.profile.link_for(runs, mesh.links[axis])


def axis_time(kind: str, nbytes: float, mesh: Mesh, axis: int, algorithm: str = "ring") -> float:
    """Seconds of ``kind`` over ``nbytes`` on mesh ``axis``, priced as the backend runs it
    (:func:`priced_as`)."""
    runs, link = priced_as(kind, mesh, axis)
    return collective_time(runs, nbytes, mesh.shape[axis], link, algorithm)


def repriced(info: CollectiveInfo, nbytes: int, mesh: Mesh) -> CollectiveInfo:
    """The same collective over ``nbytes`` (a fused bucket, a piece), priced as the backend
    runs it on a ring."""
    return dataclasses.replace(info, nbytes=nbytes, seconds=axis_time(info.kind, nbytes, mesh, info.axis))


def affine_fit(kind: str, group_size: int, link: LinkModel, itemsize: int = 4,
               algorithm: str = "ring") -> tuple[float, float]:
    """``(a, b)`` with ``time(elements) = a + b * elements`` for ``kind`` of ``itemsize``-byte
    elements (every α-β form is affine in the bytes)."""
    a = collective_time(kind, 0, group_size, link, algorithm)
    elements = 2**30
    b = (collective_time(kind, elements * itemsize, group_size, link, algorithm) - a) / elements
    return a, b
