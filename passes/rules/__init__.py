"""Per-operator SBP rules (AutoDDL signatures) as data, one module per family.

``signatures_1d(node)`` lists every valid 1-D signature of a node,
``signatures_nd(node, mesh_shape)`` the per-axis products whose splits divide,
``localize_args`` rewrites shape arguments for local shards. Operators without a
rule fall back to all-``B`` (logged once, listed by ``fallback_ops``).
"""
from . import elementwise, factory, matmul, nn, reductions, views
from .core import (LOCALIZERS, RULES, Call, Labels, NdSignature, Signature, TensorMeta, bind,
                   call_key, clear_caches, enumerate_signatures, fallback_ops, has_rule, localize_args,
                   selected_leaf, signatures_1d, signatures_nd, tensor_inputs)

for _family in (elementwise, matmul, views, reductions, nn, factory):
    RULES.update(_family.RULES)
    LOCALIZERS.update(getattr(_family, "LOCALIZERS", {}))

__all__ = ["Call", "Labels", "NdSignature", "Signature", "TensorMeta", "bind", "call_key", "clear_caches",
           "enumerate_signatures", "fallback_ops", "has_rule", "localize_args", "selected_leaf",
           "signatures_1d", "signatures_nd", "tensor_inputs"]
