"""Embedding, attention, convolution and pooling.

- embedding: indices split with the weight ``B`` -> the output split the same way;
  weight split on the embedding dim (``S1``) -> output split on its last dim; a
  vocabulary split would need masking and is not claimed. Linear in the weight.
  Its backward contracts the index dims (``P`` weight gradient).
- attention (``q, k, v: [batch, heads, L|S, E]``): batch and heads split everything;
  on the CPU kernel a non-causal, unmasked call may also split the queries (L; the
  key/value gradients are then contracted over them, ``P``). Head dims never split
  (the kernels need equal q/k/v head sizes; q.k contracts them). The backward is linear in the incoming gradient. The GPU kernels
  (flash / efficient / cudnn) use the same layout but return padded or auxiliary
  tensors (RNG state, sequence offsets) that stay ``B``; only batch and heads
  split there. They cannot run on this CPU build, so only their rule data is
  tested, not their numerics.
- convolution (groups == 1): batch splits everything, output channels split the
  weight and bias, input channels are contracted (``P``, bias ``P`` with them);
  spatial dims never split. The backward's outputs depend on different inputs
  (grad_input on grad_output and weight, grad_weight on grad_output and input,
  grad_bias on grad_output alone); it is linear in each input.
- grouped convolution (groups > 1): batch splits everything. A depthwise convolution
  (one input channel per group, MobileNet style) also splits by groups: the input's
  channels, the weight's groups dim (0), the bias and the output's channels together,
  ``groups`` localized to the local number of groups. (With more input channels per
  group an even channel split need not fall on group boundaries, so it is not
  claimed.) Linear in the input and in the weight, as without groups.
- ``embedding_dense_backward`` with a ``padding_idx``: the padding row's gradient is
  zero in every piece, so the index contraction holds as without one.
- pooling: batch and channel dims split; the backward is linear in the gradient.
- per-plane spatial operators (average, 3-D and adaptive max pooling, reflection and
  replication padding, upsampling of every mode): every dim before the ``k`` spatial
  ones they work on (batch, channels) splits everything, the spatial dims never split;
  average pooling, padding and upsampling are linear in their input, every backward in
  its gradient. An upsampling backward's ``input_size`` is localized to the gradient's
  local shape. Pixel (un)shuffle folds channels into space: only the batch splits.
- ``im2col`` / ``col2im`` (``F.unfold`` / ``F.fold``: channels and kernel positions share
  a dim): only the batch splits (none for an unbatched input); linear.
- grid sampling (``input [N, C, *in]``, ``grid [N, *out, k]``): batch splits everything,
  channels the input and output; linear in the input. Its backward is linear in the
  gradient; the grid's gradient sums over channels (``P`` under a channel split). An
  affine grid (``theta [N, k, k+1]`` -> ``[N, *out, k]``) splits by batch, its ``size``
  localized; linear in ``theta`` (its backward in the gradient).
- pairwise distances (``_cdist_forward(x1 [*, P, M], x2 [*, R, M]) -> [*, P, R]``: a
  triplet loss's hard negatives, a prototype layer): the batch dims (equal in both)
  split everything, the rows of ``x1`` and of ``x2`` the output's two last dims; the
  feature dim ``M`` never (a norm of it). The backward (the gradient of ``x1``) splits
  with ``x1``'s rows and sums over ``x2``'s (``P`` where they split); linear in the
  incoming gradient.
"""
from __future__ import annotations

import torch

from .core import UNSPLIT, Call, Labels, TensorMeta, aligned, letters

aten = torch.ops.aten


def embedding(call: Call) -> Labels:
    batch = letters(call["indices"].ndim)
    return Labels({"weight": UNSPLIT + "z", "indices": batch}, [batch + "z"], linear=[{"weight"}])


def embedding_backward(call: Call) -> Labels:
    """Index dims contract into the weight gradient (not when scaled by frequency)."""
    ndim = call["indices"].ndim
    batch = UNSPLIT * ndim if call["scale_grad_by_freq"] else letters(ndim)
    return Labels({"grad_output": batch + "z", "indices": batch}, [UNSPLIT + "z"],
                  linear=[{"grad_output"}])


# op: (is the CPU kernel, output roles); the tensor arguments are named by role below.
ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (True, "ol"),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (True, "qkv"),
    aten._scaled_dot_product_flash_attention.default: (False, "ol"),
    aten._scaled_dot_product_flash_attention_backward.default: (False, "qkv"),
    aten._scaled_dot_product_efficient_attention.default: (False, "ol"),
    aten._scaled_dot_product_efficient_attention_backward.default: (False, "qkv"),
    aten._scaled_dot_product_cudnn_attention.default: (False, "ol"),
    aten._scaled_dot_product_cudnn_attention_backward.default: (False, "qkv"),
}
ROLE_OF_ARG = {"query": "q", "key": "k", "value": "v", "out": "o", "grad_out": "o",
               "grad_out_": "o", "logsumexp": "l"}
GRADIENT_ARGS = ("grad_out", "grad_out_")


def _fit(labels: str, meta: TensorMeta) -> str:
    """Role labels, or batch and heads alone for a differently shaped (padded) tensor."""
    return labels if len(labels) == meta.ndim else "bh" + UNSPLIT * (meta.ndim - 2)


def attention(call: Call) -> Labels:
    """Labels per role: q [b,h,L,E], k [b,h,S,E], v [b,h,S,Ev], o [b,h,L,Ev], l [b,h,L].
    A mask/bias broadcasts against [b,h,L,S]; other outputs (RNG state, offsets) stay B."""
    cpu, out_roles = ATTENTION[call.target]
    queries = cpu and not call["is_causal"] and call.get("attn_mask") is None
    L = "l" if queries else UNSPLIT
    roles = {"q": "bh" + L + UNSPLIT, "k": "bh" + UNSPLIT * 2, "v": "bh" + UNSPLIT * 2,
             "o": "bh" + L + UNSPLIT}
    b, h, n_q = call["query"].shape[:3]
    n_k = call["key"].shape[2]
    inputs = {name: _fit(roles.get(role, "bh" + L), call[name]) for name, role in ROLE_OF_ARG.items()
              if isinstance(call.get(name), TensorMeta)}
    for name in ("attn_mask", "attn_bias"):
        if isinstance(call.get(name), TensorMeta):
            inputs[name] = aligned(call[name], (b, h, n_q, n_k), "bh" + UNSPLIT * 2)
    outputs, deps = [], {}
    for k, meta in enumerate(call.outputs):
        role = roles.get(out_roles[k], "bh" + L) if k < len(out_roles) else None
        if role is not None and meta is not None and meta.ndim == len(role):
            outputs.append(role)
        elif meta is not None and meta.ndim >= 2 and meta.shape[:2] == (b, h):
            outputs.append("bh" + UNSPLIT * (meta.ndim - 2))   # a debug mask or bias gradient
        else:
            outputs.append(UNSPLIT * (meta.ndim if meta is not None else 0))
            deps[k] = ()
    if out_roles == "ol":
        deps[1] = {name for name in inputs if name != "value"}
    grad = [{name} for name in GRADIENT_ARGS if name in inputs]
    return Labels(inputs, outputs, linear=grad, deps=deps)


def _conv_labels(call: Call) -> tuple[str, str, str, str]:
    """(input, weight, bias, output) labels: n batch, c in-channels, o out-channels,
    g groups (depthwise only)."""
    spatial = UNSPLIT * (call["input"].ndim - 2)
    if call["groups"] != 1:
        if call["input"].shape[1] != call["groups"]:   # batch only
            x = "n" + UNSPLIT + spatial
            return x, UNSPLIT * (len(spatial) + 2), UNSPLIT, x
        return "ng" + spatial, "g" + UNSPLIT + spatial, "g", "ng" + spatial
    weight = ("co" if call["transposed"] else "oc") + spatial
    return "nc" + spatial, weight, "o", "no" + spatial


def convolution(call: Call) -> Labels:
    x, w, b, y = _conv_labels(call)
    return Labels({"input": x, "weight": w, "bias": b}, [y], addends=["bias"],
                  linear=[{"input", "bias"}, {"weight", "bias"}])


def convolution_backward(call: Call) -> Labels:
    x, w, b, y = _conv_labels(call)
    return Labels({"grad_output": y, "input": x, "weight": w}, [x, w, b],
                  linear=[{"grad_output"}, {"input"}, {"weight"}],
                  deps={0: {"grad_output", "weight"}, 1: {"grad_output", "input"},
                        2: {"grad_output"}})


#: upsampling operators (their backward is ``<name>_backward``) -> spatial dims
UPSAMPLE = {"upsample_nearest1d": 1, "upsample_nearest2d": 2, "upsample_nearest3d": 3,
            "_upsample_nearest_exact1d": 1, "_upsample_nearest_exact2d": 2, "_upsample_nearest_exact3d": 3,
            "upsample_linear1d": 1, "upsample_bilinear2d": 2, "upsample_bicubic2d": 2,
            "_upsample_bilinear2d_aa": 2, "_upsample_bicubic2d_aa": 2, "upsample_trilinear3d": 3}


def _pool_labels(meta) -> str:
    return letters(meta.ndim - 2) + UNSPLIT * 2


def max_pool(call: Call) -> Labels:
    labels = _pool_labels(call["self"])
    return Labels({"self": labels}, [labels, labels])


def max_pool_backward(call: Call) -> Labels:
    labels = _pool_labels(call["self"])
    return Labels({"grad_output": labels, "self": labels, "indices": labels}, [labels],
                  linear=[{"grad_output"}])


def adaptive_avg_pool(call: Call) -> Labels:
    labels = _pool_labels(call["self"])
    return Labels({"self": labels}, [labels], linear=[{"self"}])


def adaptive_avg_pool_backward(call: Call) -> Labels:
    labels = _pool_labels(call["self"])
    return Labels({"grad_output": labels, "self": labels}, [labels], linear=[{"grad_output"}])


def _per_plane(spatial: int, tensors: tuple[str, ...], outputs: int, linear: str | None):
    """The rule of an operator that works on each (batch, channel) plane alone, on its
    last ``spatial`` dims: its ``tensors`` arguments and its ``outputs`` share the leading
    labels; ``linear``: the argument it is linear in (None: not linear)."""
    def rule(call: Call) -> Labels:
        first = next(call[name] for name in tensors if isinstance(call.get(name), TensorMeta))
        labels = letters(first.ndim - spatial) + UNSPLIT * spatial
        inputs = {name: labels for name in tensors if isinstance(call.get(name), TensorMeta)}
        return Labels(inputs, [labels] * outputs, linear=[{linear}] if linear else [])
    return rule


#: per-plane operators: op -> (spatial dims, tensor arguments, outputs, linear in)
PER_PLANE = {
    aten.avg_pool2d.default: (2, ("self",), 1, "self"),
    aten.avg_pool2d_backward.default: (2, ("grad_output", "self"), 1, "grad_output"),
    aten.avg_pool3d.default: (3, ("self",), 1, "self"),
    aten.avg_pool3d_backward.default: (3, ("grad_output", "self"), 1, "grad_output"),
    aten.max_pool3d_with_indices.default: (3, ("self",), 2, None),
    aten.max_pool3d_with_indices_backward.default: (3, ("grad_output", "self", "indices"), 1, "grad_output"),
    aten.adaptive_max_pool2d.default: (2, ("self",), 2, None),
    aten.adaptive_max_pool2d_backward.default: (2, ("grad_output", "self", "indices"), 1, "grad_output"),
    aten.adaptive_max_pool3d.default: (3, ("self",), 2, None),
    aten.adaptive_max_pool3d_backward.default: (3, ("grad_output", "self", "indices"), 1, "grad_output"),
    aten._adaptive_avg_pool3d.default: (3, ("self",), 1, "self"),
    aten._adaptive_avg_pool3d_backward.default: (3, ("grad_output", "self"), 1, "grad_output"),
    **{getattr(aten, f"{kind}_pad{k}d").default: (k, ("self",), 1, "self")
       for kind in ("reflection", "replication") for k in (1, 2, 3)},
    **{getattr(aten, f"{kind}_pad{k}d_backward").default: (k, ("grad_output", "self"), 1, "grad_output")
       for kind in ("reflection", "replication") for k in (1, 2, 3)},
    **{getattr(aten, name).default: (k, ("self",), 1, "self") for name, k in UPSAMPLE.items()},
    **{getattr(aten, f"{name}_backward").default: (k, ("grad_output",), 1, "grad_output")
       for name, k in UPSAMPLE.items()},
    aten.pixel_shuffle.default: (3, ("self",), 1, "self"),
    aten.pixel_unshuffle.default: (3, ("self",), 1, "self"),
}


def _grid_labels(call: Call) -> tuple[str, str]:
    """(input and output, grid) labels: n batch, c channels; space never splits."""
    return "nc" + UNSPLIT * (call["input"].ndim - 2), "n" + UNSPLIT * (call["grid"].ndim - 1)


def grid_sampler(call: Call) -> Labels:
    x, grid = _grid_labels(call)
    return Labels({"input": x, "grid": grid}, [x], linear=[{"input"}])


def grid_sampler_backward(call: Call) -> Labels:
    x, grid = _grid_labels(call)
    return Labels({"grad_output": x, "input": x, "grid": grid}, [x, grid], linear=[{"grad_output"}],
                  deps={0: {"grad_output", "grid"}, 1: {"grad_output", "input", "grid"}})


def affine_grid(call: Call) -> Labels:
    name = "theta" if call.target is aten.affine_grid_generator.default else "grad"
    out = "n" + UNSPLIT * (call.outputs[0].ndim - 1)
    return Labels({name: "n" + UNSPLIT * (call[name].ndim - 1)}, [out], linear=[{name}])


def affine_grid_size(call: Call, in_shapes, out_shapes) -> dict:
    """``size`` (the grid's ``[N, C, *out]``) takes the local batch."""
    return {"size": [in_shapes[0][0], *call["size"][1:]]}


def columns(call: Call) -> Labels:
    """im2col ``[N, C, H, W] -> [N, C*k*k, L]``, col2im back: the batch alone splits."""
    batched = call["self"].ndim == (4 if call.target is aten.im2col.default else 3)
    first = "n" if batched else UNSPLIT
    x = first + UNSPLIT * (call["self"].ndim - 1)
    return Labels({"self": x}, [first + UNSPLIT * (call.outputs[0].ndim - 1)], linear=[{"self"}])


def upsample_backward_size(call: Call, in_shapes, out_shapes) -> dict:
    """An upsampling backward's ``input_size`` is its (local) output's shape."""
    return {"input_size": list(out_shapes[0])}


def _cdist_labels(call: Call, distances: int) -> tuple[str, str, str]:
    """(x1, x2, the ``distances``-d distances) labels of a pairwise distance; nothing
    splits where the batch dims differ (broadcast)."""
    x1, x2 = call["x1"], call["x2"]
    if x1.ndim != x2.ndim or x1.shape[:-2] != x2.shape[:-2]:
        return UNSPLIT * x1.ndim, UNSPLIT * x2.ndim, UNSPLIT * distances
    batch = letters(x1.ndim - 2)
    return batch + "p" + UNSPLIT, batch + "r" + UNSPLIT, batch + "pr"


def cdist(call: Call) -> Labels:
    x1, x2, distances = _cdist_labels(call, call.outputs[0].ndim)
    return Labels({"x1": x1, "x2": x2}, [distances])


def cdist_backward(call: Call) -> Labels:
    x1, x2, distances = _cdist_labels(call, call["cdist"].ndim)
    return Labels({"grad": distances, "x1": x1, "x2": x2, "cdist": distances}, [x1], linear=[{"grad"}])


RULES = {
    **{op: _per_plane(*entry) for op, entry in PER_PLANE.items()},
    aten._cdist_forward.default: cdist, aten._cdist_backward.default: cdist_backward,
    aten.im2col.default: columns, aten.col2im.default: columns,
    aten.grid_sampler_2d.default: grid_sampler, aten.grid_sampler_3d.default: grid_sampler,
    aten.grid_sampler_2d_backward.default: grid_sampler_backward,
    aten.grid_sampler_3d_backward.default: grid_sampler_backward,
    aten.affine_grid_generator.default: affine_grid,
    aten.affine_grid_generator_backward.default: affine_grid,
    aten.embedding.default: embedding,
    aten.embedding_dense_backward.default: embedding_backward,
    **dict.fromkeys(ATTENTION, attention),
    aten.convolution.default: convolution,
    aten.convolution_backward.default: convolution_backward,
    aten.max_pool2d_with_indices.default: max_pool,
    aten.max_pool2d_with_indices_backward.default: max_pool_backward,
    aten._adaptive_avg_pool2d.default: adaptive_avg_pool,
    aten._adaptive_avg_pool2d_backward.default: adaptive_avg_pool_backward,
}


def _local_groups(call: Call, in_shapes) -> dict:
    """``groups`` is the local number of groups. Only a depthwise convolution (one input
    channel per group) splits by groups, so its local groups are its local input channels;
    any other keeps all its groups and channels. Hence ``min(groups, local channels)``,
    which needs no global shape (``call`` may hold local values already: localization runs
    in graph order) and holds for transposed convolutions too."""
    if call["groups"] == 1:
        return {}
    slot = [name for name, _ in call.slots].index("input")
    groups = min(call["groups"], in_shapes[slot][1])
    return {} if groups == call["groups"] else {"groups": groups}


def conv_groups(call: Call, in_shapes, out_shapes) -> dict:
    return _local_groups(call, in_shapes)


def conv_backward_args(call: Call, in_shapes, out_shapes) -> dict:
    """bias_sizes is the local number of output channels (grad_output's dim 1); groups as
    in the forward."""
    changes = _local_groups(call, in_shapes)
    if call["bias_sizes"] is not None:
        changes["bias_sizes"] = [in_shapes[0][1]]
    return changes


LOCALIZERS = {aten.convolution.default: conv_groups,
              aten.convolution_backward.default: conv_backward_args,
              **{getattr(aten, f"{name}_backward").default: upsample_backward_size for name in UPSAMPLE},
              aten.affine_grid_generator.default: affine_grid_size,
              aten.affine_grid_generator_backward.default: affine_grid_size}
