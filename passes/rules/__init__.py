"""Per-operator SBP rules (AutoDDL signatures) as data, one module per family.

``signatures_1d(node)`` lists every valid 1-D signature of a node,
``signatures_nd(node, mesh_shape)`` the per-axis products whose splits divide,
``localize_args`` rewrites shape arguments for local shards. A rule is found by
operator or, for a family, by torch op tag (every pointwise op is elementwise;
``rule_for``). Operators without a rule fall back to all-``B`` (logged once, listed
by ``fallback_ops``).
"""
from . import elementwise, factory, indexing, matmul, nn, optimizer, reductions, views
from .core import (LOCALIZERS, RULES, TAG_RULES, Call, Labels, NdSignature, Signature, TensorMeta,
                   bind, call_key, clear_caches, enumerate_signatures, fallback_ops, has_rule,
                   is_functional, is_tensor_node, localize_args, rule_for, selected_leaf,
                   signatures_1d, signatures_nd, tensor_inputs)

for _family in (elementwise, matmul, views, indexing, reductions, nn, factory, optimizer):
    RULES.update(_family.RULES)
    TAG_RULES.update(getattr(_family, "TAG_RULES", {}))
    LOCALIZERS.update(getattr(_family, "LOCALIZERS", {}))

__all__ = ["Call", "Labels", "NdSignature", "Signature", "TensorMeta", "bind", "call_key", "clear_caches",
           "enumerate_signatures", "fallback_ops", "has_rule", "is_functional", "is_tensor_node",
           "localize_args", "rule_for", "selected_leaf", "signatures_1d", "signatures_nd", "tensor_inputs"]
