"""Cost models: pure functions from shapes, SBP and mesh to seconds and bytes."""
from .boxing import STEP_KINDS, BoxingPlan, BoxingStep, boxing_cost, boxing_seconds
from .collectives import (ALGORITHMS, COLLECTIVES, SYMBOLS, ceil_log2, cheapest_algorithm,
                          collective_expr, collective_time)
from .compute import FLOP_ALIASES, op_bytes, op_flops, op_time
from .memory import MemoryReport, memory_report, peak_live_bytes, tensor_bytes

__all__ = ["STEP_KINDS", "BoxingPlan", "BoxingStep", "boxing_cost", "boxing_seconds",
           "ALGORITHMS", "COLLECTIVES", "SYMBOLS", "ceil_log2", "cheapest_algorithm",
           "collective_expr", "collective_time", "FLOP_ALIASES", "op_bytes", "op_flops", "op_time",
           "MemoryReport", "memory_report", "peak_live_bytes", "tensor_bytes"]
