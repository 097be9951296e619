"""Wait for every collective right after issuing it: the program a gloo rank runs.

On gloo (torch 2.13, CPU), ``_c10d_functional`` collectives corrupt the heap when several
are in flight on a process group at once: a worker aborts in ``malloc`` ("unaligned tcache
chunk detected") or dies of SIGSEGV, at random, a few times in ten runs of a few thousand
steps on a loaded machine, without ddlc: issuing three ``all_gather_into_tensor`` and then
waiting for them crashed 3 of 6 runs of 3000 such steps on 4 ranks; the same
all-gathers issued through ``torch.distributed.all_gather_into_tensor(..., async_op=True)``
(0 of 10 runs), or each waited before the next is issued (0 of 4), never did. A heap
corrupted under a tensor can also change numbers silently, so a gloo rank runs its
program with one collective in flight at a time: each ``wait_tensor`` moves to right after
its collective. Values, the collective sequence (the issue order) and every node's meta
are unchanged; what is lost is the overlap of a collective with the computation after it,
which the ``cpu-gloo`` profile does not count anyway (the ranks share the host's cores, so
its timeline runs every task on the compute stream).
"""
from __future__ import annotations

from torch import fx

from ddlc.ir import is_collective, is_wait

__all__ = ["wait_at_once"]


def wait_at_once(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each collective's wait (``check_waits``: its only users) to right after it."""
    for node in list(gm.graph.nodes):
        if is_collective(node):
            for wait in [u for u in node.users if is_wait(u)]:
                node.append(wait)
    gm.graph.lint()
    gm.recompile()
    return gm
