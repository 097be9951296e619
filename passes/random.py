"""Give every random operator of a lowered graph the program's generator (ddlc.rng).

Each random node (``bernoulli`` for dropout, ``rand``, ``randn``, ...) becomes a call
of :func:`ddlc.rng.draw` that draws the node's *global* shape from the generator
held by the graph module (``gm.rng``, one ``get_attr`` node) and keeps this rank's
piece: the slices of the node's SBP at the rank's mesh coordinate. Every rank thus
draws the same numbers in the same order, whatever its own default generator. Each
draw takes the previous one as an (unused) argument, so no reordering pass can
change the order in which the generator is consumed.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch
from torch import fx

from ddlc import rng
from ddlc.errors import LoweringError
from ddlc.ir import DRAW_STRIDES, GLOBAL_VAL, ORIGIN, RANK_ARG, SHARDING, RankArg, is_wait, where
from ddlc.mesh import Mesh
from ddlc.sbp import local_slices

__all__ = ["draw_globally"]

#: the graph module attribute that holds the program's generator
GENERATOR = "rng"


def draw_globally(gm: fx.GraphModule, mesh: Mesh, coord: Sequence[int]) -> fx.GraphModule:
    """Replace every random node of the localized ``gm`` by a draw of its global shape
    from ``gm.rng`` (a fresh generator seeded 0 when ``gm`` has none), sliced to this
    rank's piece."""
    draws = [n for n in gm.graph.nodes if rng.draws_random_numbers(n)]
    if not draws:
        return gm
    if not hasattr(gm, GENERATOR):
        setattr(gm, GENERATOR, torch.Generator().manual_seed(0))
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Attempted to insert a get_attr Node")  # not a tensor
        generator = gm.graph.get_attr(GENERATOR)
    generator.meta["val"] = None
    if ORIGIN.has(first):
        ORIGIN.set(generator, ORIGIN(first))
    previous, read = None, set()
    for node in draws:
        if not rng.supported(node):
            raise LoweringError(f"{node.name} ({node.target}) draws random numbers that depend on "
                                "an input's values, which ddlc.rng cannot keep consistent",
                                where=where(node))
        whole, sbp = GLOBAL_VAL(node), SHARDING(node).output
        if any(x.is_partial for x in sbp):
            raise LoweringError(f"{node.name} ({node.target}) draws random numbers but is planned "
                                f"as a partial sum {sbp}", where=where(node))
        piece = local_slices(tuple(whole.shape), sbp, mesh.shape, coord)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(rng.draw, (generator, previous, str(node.target),
                                                    tuple(whole.shape), whole.dtype,
                                                    rng.scalars(node), tuple(piece), DRAW_STRIDES.get(node)))
        new.meta.update(node.meta)
        RANK_ARG.set(new, RankArg(6, "piece", shape=tuple(whole.shape), sbp=sbp))
        node.replace_all_uses_with(new)
        read.update(node.all_input_nodes)
        gm.graph.erase_node(node)
        previous = new
    # a draw needs no input's values (dropout's bernoulli read its template's shape only):
    # a collective that brought an input only for it goes, with its wait (fx keeps a wait)
    for unread in [n for n in gm.graph.nodes if n in read and is_wait(n) and not n.users]:
        gm.graph.erase_node(unread)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
