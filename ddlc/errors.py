"""The one exception hierarchy of ddlc.

Every error names its cause; where a graph node is involved it also names the
node, the operator and the user's source line (``where``).
"""
from __future__ import annotations


class DDLCError(Exception):
    """Base class of every error ddlc raises on purpose."""

    def __init__(self, message: str, *, where: str | None = None):
        self.where = where
        super().__init__(f"{message}\n  at {where}" if where else message)


class MeshError(DDLCError, ValueError):
    """A mesh shape, axis name, profile or world size that cannot be used."""


class SBPError(DDLCError, ValueError):
    """An SBP or placement that is malformed or does not fit a tensor."""


class FactoryError(DDLCError, ValueError):
    """A model factory (``file.py:name`` or ``module:name``) that cannot be found, loaded or
    called, or that returns something other than ``(model, example_inputs, loss_fn)``."""


class TraceError(DDLCError):
    """The model or training step cannot be traced into one graph."""


class UnsupportedInputError(TraceError, TypeError):
    """An example input, loss function or optimizer that ddlc does not accept."""


class ShardingError(DDLCError):
    """No valid or affordable sharding exists (e.g. memory budget infeasible)."""


class LoweringError(DDLCError):
    """A plan cannot be turned into a per-rank program."""


class RuntimeMismatchError(DDLCError, RuntimeError):
    """Ranks disagree (world size, collective order) or a worker failed."""


class OptionError(DDLCError, ValueError):
    """An unknown, malformed or contradictory ``compile`` option (the message names it)."""


class RandomStreamWarning(UserWarning):
    """A compiled program's random numbers are not the ones eager would draw: the loop drew
    from, or seeded, the default generator between compiled calls, and the program goes on
    from its own stream without those draws."""


class MemoryBudgetWarning(UserWarning):
    """The lowered program's modeled peak memory per device exceeds ``memory_budget``: the
    search keeps the plan's resident tensors within the budget, not the buffers lowering
    adds (all-gathered weights, gradient buckets, pieces) nor the order's live ranges."""


def as_shared(error: Exception, what: str) -> DDLCError:
    """``error`` as another process raises it: itself where it is a ddlc error, else a
    :class:`RuntimeMismatchError` naming ``what`` failed (e.g. "rank 0 failed while
    planning") and the original error."""
    if isinstance(error, DDLCError):
        return error
    return RuntimeMismatchError(f"{what}: {type(error).__name__}: {error}")
