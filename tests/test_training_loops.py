"""Real training loops on simulated ranks (every rank's program in one process, see
``ddlc.simulate``) against eager single-device training: BatchNorm in training mode
(the statistics of the whole batch, as SyncBatchNorm), dropout drawn from one random
stream for all ranks, gradient clipping by global norm, Adam with L2 weight decay,
parameter groups, frozen parameters, dict batches and models that compute their own
loss."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune
from torch import nn

import ddlc
from conftest import MESHES, assert_matches_reference, eager, simulated
from ddlc import zoo
from ddlc.ir import STEP
from ddlc.launch import spawn

def _images(n_steps=3, batch=8, size=32, classes=10):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(n_steps)]


def _matches_eager(model, loss_fn, make_optimizer, data, mesh_shape, **tolerances):
    """Train ``model`` on simulated ranks of ``mesh_shape`` and a copy of it eagerly on the
    same ``data``; assert their losses and parameters match; return the simulated run's
    parameters, buffers and graph, and the eagerly trained copy."""
    reference = copy.deepcopy(model)
    losses, params, buffers, gm = simulated(model, loss_fn, make_optimizer, data, mesh_shape)
    want, _ = eager(reference, loss_fn, make_optimizer, data)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())}, **tolerances)
    return params, buffers, gm, reference


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_batchnorm_training_uses_the_whole_batch_statistics(mesh_shape):
    """ResNet-18 (tiny) in training mode, batch split over every rank: losses, parameters
    and running statistics (num_batches_tracked included) equal single-device training,
    which needs the batch mean and variance reduced across ranks."""
    torch.manual_seed(0)
    model = zoo.resnet18(num_classes=10, width=4)
    reference = copy.deepcopy(model)
    data = _images()
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)  # noqa: E731
    losses, params, buffers, gm = simulated(model, F.cross_entropy, sgd, data, mesh_shape)
    want_losses, _ = eager(reference, F.cross_entropy, sgd, data)
    assert {o.key for o in STEP(gm).outputs if o.role == "buffer"} == {
        k for k, _ in reference.named_buffers()}
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want_losses, "params": dict(reference.named_parameters())})
    for name, value in reference.named_buffers():
        torch.testing.assert_close(buffers[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert int(buffers["bn1.num_batches_tracked"]) == len(data)


class _UNetish(nn.Module):
    """GroupNorm, reflection padding, average pooling, nearest and bilinear upsampling, a
    spatial transformer (affine grid and grid sampling) and a pixel shuffle: operators
    that work on each (sample, channel) plane alone."""

    def __init__(self):
        super().__init__()
        self.inc = nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect")
        self.gn = nn.GroupNorm(2, 8)
        self.loc = nn.Linear(8, 6)
        self.down = nn.Conv2d(8, 16, 3, padding=1)
        self.up = nn.Conv2d(16, 8, 1)
        self.sub = nn.Conv2d(8, 12, 3, padding=1)
        self.head = nn.Linear(3 * 32 * 32, 10)

    def forward(self, x):
        h = F.silu(self.gn(self.inc(x)))
        d = F.avg_pool2d(F.relu(self.down(h)), 2)
        u = self.up(F.interpolate(d, scale_factor=2, mode="nearest")) + \
            F.interpolate(h, size=(32, 32), mode="bilinear", align_corners=False)
        theta = 0.1 * self.loc(h.mean((2, 3))).view(-1, 2, 3) + torch.eye(2, 3)
        u = F.grid_sample(u, F.affine_grid(theta, list(u.shape), align_corners=False), align_corners=False)
        y = F.pixel_shuffle(self.sub(F.adaptive_max_pool2d(u, 16)), 2)
        return self.head(y.flatten(1))


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_per_plane_operators_train_data_parallel(mesh_shape):
    """Those operators split by batch (and channels): the model trains as pure data
    parallelism (``move_activations=False``, refused before: no rule let them split) and
    matches eager training, statistics of GroupNorm included."""
    torch.manual_seed(0)
    model = _UNetish()
    reference = copy.deepcopy(model)
    data = _images(n_steps=2)
    adam = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)  # noqa: E731
    losses, params, _, _ = simulated(model, F.cross_entropy, adam, data, mesh_shape, move_activations=False)
    want, _ = eager(reference, F.cross_entropy, adam, data)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_a_segmentation_loss_trains_data_parallel(mesh_shape):
    """Per-pixel cross-entropy (``nll_loss2d``) with ignored pixels, the batch split: pure
    data parallelism, as eager trains (the loss's mean is a sum over every rank's pixels
    divided by the count of those not ignored)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 5, 1))
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    data = []
    for _ in range(2):
        target = torch.randint(0, 5, (8, 16, 16), generator=g)
        target[:2, :4] = -100
        data.append((torch.randn(8, 3, 16, 16, generator=g), target))
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    losses, params, _, _ = simulated(model, F.cross_entropy, sgd, data, mesh_shape, move_activations=False)
    want, _ = eager(reference, F.cross_entropy, sgd, data)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})


CNN_ZOO = {"resnet18": lambda: zoo.resnet18(width=4), "resnet50": lambda: zoo.resnet50(width=4),
           "vgg16_bn": lambda: zoo.vgg16_bn(width=4), "mobilenet_v2": lambda: zoo.mobilenet_v2(width_mult=0.25)}


@pytest.mark.parametrize("name", list(CNN_ZOO))
def test_no_op_of_the_cnn_zoo_falls_back(name):
    """Training steps (BatchNorm with batch statistics, dropout, depthwise convolution,
    ReLU6) and eval-mode forwards (BatchNorm with running statistics) of the CNN zoo:
    every operator has a sharding rule."""
    from passes.rules import fallback_ops
    torch.manual_seed(0)
    model = CNN_ZOO[name]()
    x, y = _images(1, batch=4)[0]
    train = ddlc.trace(model, (x, y), F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    assert fallback_ops(train) == []
    assert fallback_ops(ddlc.trace(model.eval(), x)) == []


#: model, mesh, steps, learning rate, (rtol, atol) of losses and parameters. The tiny
#: MobileNetV2 (8-channel layers normalized over a handful of values) has gradients in the
#: tens and trains chaotically: in eager PyTorch a 1e-6 relative change of its weights
#: moves the third step's loss in the third digit, and float64 disagrees with float32 as
#: much (measured at lr 1e-2, 1e-3 and 1e-4, 32x32 and 64x64 images). So it runs 2 small
#: steps, compared within the float32 noise those steps show.
MORE_CNNS = [("mobilenet_v2", (2,), 2, 1e-4, (1e-4, 1e-4)), ("vgg16_bn", (4,), 3, 1e-2, (1e-4, 1e-5))]


@pytest.mark.parametrize("name,mesh_shape,steps,lr,tolerance", MORE_CNNS, ids=[c[0] for c in MORE_CNNS])
def test_more_cnns_with_batchnorm_train_like_single_device(name, mesh_shape, steps, lr, tolerance):
    """MobileNetV2 (depthwise convolutions split by groups, ReLU6, BatchNorm, dropout) and
    VGG-16-BN (BatchNorm, dropout 0.5 in the classifier) in training mode: equal to
    single-device training, running statistics included."""
    torch.manual_seed(0)
    model = CNN_ZOO[name]()
    reference = copy.deepcopy(model)
    data = _images(steps)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)  # noqa: E731
    batch_sbp = "(" + ", ".join(["S0"] * len(mesh_shape)) + ")"  # the batch split on every axis
    losses, params, buffers, _ = simulated(model, F.cross_entropy, sgd, data, mesh_shape, batch_sbp)
    want, _ = eager(reference, F.cross_entropy, sgd, data, seed=0)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())},
                             losses=tolerance, params=tolerance)
    for key, value in reference.named_buffers():
        torch.testing.assert_close(buffers[key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_batchnorm_per_rank_statistics_would_differ():
    """The check above can fail: each quarter of the batch has other statistics."""
    x = _images(1)[0][0]
    whole = x.mean((0, 2, 3))
    assert not torch.allclose(x[:2].mean((0, 2, 3)), whole, atol=1e-3)


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_a_cumulative_batchnorm_average_reads_the_count_each_step(mesh_shape):
    """BatchNorm with ``momentum=None`` moves its running statistics by ``1 / count`` of the
    batches it has seen, the count taken at each step (here from 5, trained eagerly before
    compile), on batches whose statistics drift from step to step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 8 * 8, 16), nn.BatchNorm1d(16, momentum=None),
                          nn.Linear(16, 4))
    for norm in (model[1], model[5]):
        norm.num_batches_tracked.fill_(5)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 3, 8, 8, generator=g) * (i + 1) + i, torch.randint(0, 4, (8,), generator=g))
            for i in range(4)]
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    _, buffers, _, reference = _matches_eager(model, F.cross_entropy, sgd, data, mesh_shape)
    for name, value in reference.named_buffers():
        torch.testing.assert_close(buffers[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert int(buffers["1.num_batches_tracked"]) == 9


class _DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return F.dropout(self.fc2(self.drop(F.relu(self.fc1(x)))), 0.1, self.training)


def _regression(n_steps=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(n_steps)]


class _Temperature(nn.Module):
    """Logits scaled by a learnable 0-d parameter (CLIP's ``logit_scale``)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.fc(x) * self.scale.exp()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_zero_dim_parameter_keeps_its_dtype(optimizer):
    """A 0-d float32 parameter and its optimizer state leave the step float32 and 0-d, as
    they enter it, and train as eagerly: the update's scalars are 0-d float64 tensors,
    which promote a 0-d tensor (the step returned them float64 with SGD, and AdamW failed
    in its second step's ``lerp``)."""
    torch.manual_seed(0)
    model = _Temperature()
    make = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
            "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.1)}[optimizer]
    data = _regression()
    _, _, gm, _ = _matches_eager(model, F.mse_loss, make, data, (2, 2))
    sig = STEP(gm)
    entering = {(i.role, i.key): n.meta["val"] for i, n in zip(sig.inputs, gm.graph.find_nodes(op="placeholder"))}
    (output,) = gm.graph.find_nodes(op="output")
    leaving = {(o.role, o.key): n.meta["val"] for o, n in zip(sig.outputs, output.args[0])}
    scale = [key for key in leaving if key[0] in ("param", "opt_state") and "scale" in str(key[1])]
    assert len(scale) == {"sgd": 2, "adamw": 4}[optimizer]
    for key in scale:
        assert (leaving[key].dtype, leaving[key].shape) == (entering[key].dtype, entering[key].shape), key


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_dropout_masks_equal_single_device_with_the_same_seed(mesh_shape):
    """Dropout on a split batch: every rank draws from the program's generator (seeded
    as the single-device run), so the masks, and with them the whole run, are equal."""
    torch.manual_seed(0)
    model = _DropoutMLP()
    reference = copy.deepcopy(model)
    data = _regression()
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05)  # noqa: E731
    losses, params, _, _ = simulated(model, F.mse_loss, sgd, data, mesh_shape)
    want, _ = eager(reference, F.mse_loss, sgd, data, seed=0)  # the simulated program's seed
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})
    without, _ = eager(copy.deepcopy(model), F.mse_loss, sgd, data, seed=1)
    assert not torch.allclose(torch.stack(without), torch.stack(want))  # the masks matter


class _UnreadDraws(_DropoutMLP):
    """A dropout whose result nothing reads (a head the loss leaves out) and an unused
    ``torch.rand`` at the end of forward."""

    def forward(self, x):
        out = super().forward(x)
        F.dropout(out, 0.5, self.training)
        torch.rand(4)
        return out


def test_draws_nothing_reads_still_advance_the_generator():
    """Eager draws the numbers of a random operator whose result nothing reads, so the
    next step's masks come after them; lowering had removed such a draw as dead code
    where it was the step's last, and every later mask was shifted."""
    torch.manual_seed(0)
    model = _UnreadDraws()
    reference = copy.deepcopy(model)
    data = _regression()
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05)  # noqa: E731
    losses, params, _, _ = simulated(model, F.mse_loss, sgd, data, (4,))
    want, _ = eager(reference, F.mse_loss, sgd, data, seed=0)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})


def _two_groups_and_a_frozen_bias():
    """An MLP whose last bias is frozen, a copy, batches and Adam over two param groups."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    model[2].bias.requires_grad_(False)

    def adam(m):
        return torch.optim.Adam([{"params": m[0].parameters(), "lr": 1e-2},
                                 {"params": m[2].parameters(), "lr": 3e-3, "weight_decay": 0.1}],
                                eps=1e-4)
    return model, copy.deepcopy(model), _regression(), adam


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_clipping_adam_groups_and_frozen_parameters(mesh_shape):
    """Clip to a global norm of 0.5 (the norm over sharded gradients is reduced across the
    mesh), with Adam's L2 weight decay, two parameter groups and a frozen bias."""
    model, reference, data, adam = _two_groups_and_a_frozen_bias()
    losses, params, _, gm = simulated(model, F.mse_loss, adam, data, mesh_shape, clip_grad_norm=0.5)
    want, norm = eager(reference, F.mse_loss, adam, data, clip=0.5)
    assert norm > 0.5  # clipping is active
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})
    assert [o.role for o in STEP(gm).outputs][:2] == ["loss", "grad_norm"]


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_clipping_by_value_clamps_each_reduced_gradient(mesh_shape):
    """``clip_grad_value`` clamps every gradient as ``clip_grad_value_`` does: after the
    reduction across the ranks holding the batch (a clamp of each rank's partial sum would
    clip other numbers)."""
    model, reference, data, adam = _two_groups_and_a_frozen_bias()
    unclipped = copy.deepcopy(reference)
    losses, params, _, gm = simulated(model, F.mse_loss, adam, data, mesh_shape, clip_grad_value=0.02)
    want, _ = eager(reference, F.mse_loss, adam, data, clip_value=0.02)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})
    eager(unclipped, F.mse_loss, adam, data)
    assert not torch.allclose(unclipped[0].weight, reference[0].weight, rtol=1e-3)  # clipping is active
    assert [o.role for o in STEP(gm).outputs][1] != "grad_norm"


def test_clipping_a_complex_gradient_by_value_is_refused():
    """torch's clamp refuses complex numbers, so ``clip_grad_value_`` raises on a complex
    gradient: the step is refused at compile, naming the parameter."""
    from ddlc.errors import UnsupportedInputError
    model = _SpectralFilter()
    data = (torch.randn(8, 8, 8), torch.randint(0, 4, (8,)))
    with pytest.raises(UnsupportedInputError, match="clip_grad_value .*complex parameters \\(filter\\)"):
        ddlc.trace(model, data, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                   clip_grad_value=0.1)


class _OwnLoss(nn.Module):
    """A model as Hugging Face writes one: keyword inputs, a dict output with the loss."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)

    def forward(self, input_ids, attention_mask=None, labels=None):
        hidden = self.emb(input_ids) * attention_mask[..., None]
        logits = self.head(hidden)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()) if labels is not None else None
        return {"loss": loss, "logits": logits}


def test_a_dict_batch_and_the_models_own_loss():
    torch.manual_seed(0)
    model = _OwnLoss()
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, 32, (8, 6), generator=g),
             "attention_mask": (torch.rand(8, 6, generator=g) > 0.2).long(),
             "labels": torch.randint(0, 32, (8, 6), generator=g)} for _ in range(3)]
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    _matches_eager(model, None, sgd, data, (2, 2))


class _Autocast(nn.Module):
    """A forward that runs its matmuls in bfloat16 under torch.autocast."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.fc2(F.gelu(self.fc1(x))).float()


def test_autocast_bfloat16_forward():
    """The autocast casts are traced into the step (``_to_copy`` to bfloat16 and back); the
    sharded program equals single-device mixed-precision training up to bfloat16's
    rounding of differently ordered sums."""
    torch.manual_seed(0)
    model = _Autocast()
    data = _regression()
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05)  # noqa: E731
    _, _, gm, _ = _matches_eager(model, F.mse_loss, sgd, data, (2, 2), losses=(1e-3, 1e-4), params=(1e-3, 1e-4))
    assert any(n.kwargs.get("dtype") == torch.bfloat16 for n in gm.graph.nodes if n.op == "call_function")


class _Recurrent(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn, self.fc = cell(6, 12, batch_first=True), nn.Linear(12, 3)

    def forward(self, x):
        return self.fc(self.rnn(x)[0])


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_recurrent_layers_train_like_single_device(cell, mesh_shape):
    """The LSTM's ``mkldnn_rnn_layer`` reads its input as a contiguous buffer whatever its
    strides: given the transposed input as a view (passes/views.py), it computed another
    sequence, with wrong losses from the first step even on one device. Vendor kernels get
    contiguous inputs."""
    torch.manual_seed(0)
    model = _Recurrent(cell)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 5, 6, generator=g), torch.randn(8, 5, 3, generator=g)) for _ in range(3)]
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=0.01)  # noqa: E731
    _matches_eager(model, F.mse_loss, adamw, data, mesh_shape)


class _InstanceNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.norm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)

    def forward(self, x):
        return self.norm(self.conv(x))


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_instance_norm_running_statistics_on_a_split_batch(mesh_shape):
    """``F.instance_norm`` traces as ``native_batch_norm`` of the running statistics
    repeated per sample, whose CPU kernel updates that repeat in place though its schema
    says nothing (the new statistics are then read from it): the running statistics came
    out stale or averaged over one rank's samples. Canonicalization makes the update a
    value of the graph (``_native_batch_norm_legit_functional``)."""
    torch.manual_seed(0)
    model = _InstanceNormNet()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 3, 6, 6, generator=g), torch.randn(8, 4, 6, 6, generator=g)) for _ in range(3)]
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    _, buffers, _, reference = _matches_eager(model, F.mse_loss, sgd, data, mesh_shape)
    for name, value in reference.named_buffers():
        torch.testing.assert_close(buffers[name], value, rtol=1e-4, atol=1e-5, msg=name)


class _DirectBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x):
        return torch.batch_norm(x, self.weight, None, self.mean, self.var, True, 0.1, 1e-5, False)


def test_a_batch_norm_kernel_called_directly_is_refused():
    """``torch.batch_norm`` updates the running statistics in place behind its schema's
    back, so the traced step would leave them as they were: refused at the user's line."""
    from ddlc.errors import UnsupportedInputError
    model = _DirectBatchNorm()
    with pytest.raises(UnsupportedInputError, match="running statistics") as caught:
        ddlc.trace(model, (torch.randn(8, 4), torch.randn(8, 4)), F.mse_loss,
                   torch.optim.SGD(model.parameters(), lr=0.1))
    assert "test_training_loops.py" in str(caught.value) and "torch.batch_norm(" in str(caught.value)


def test_a_float64_model_trains_in_float64():
    """The hyper-parameters enter the step in float64, as torch's optimizers compute with
    them (Python floats): in float32, Adam's bias correction ``1 - 0.999 ** t`` alone was
    off by 1e-5 relative, so a float64 model trained with float32-sized errors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).double()
    data = [(x.double(), y.double()) for x, y in _regression()]
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=0.01)  # noqa: E731
    _matches_eager(model, F.mse_loss, adamw, data, (4,), losses=(1e-12, 1e-14), params=(1e-12, 1e-14))


_CLASS_WEIGHTS = torch.tensor([1.0, 2.0, 0.5, 1.5, 1.0])


class _ScaledHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.c = nn.Linear(6, 16), nn.Linear(16, 5)

    def forward(self, x):
        return self.c(torch.relu(self.a(x))) * _CLASS_WEIGHTS  # a tensor from outside the model


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_tensors_captured_from_outside_the_model_are_constants(mesh_shape):
    """Class weights kept in a global, read by the forward and by the loss: they become
    constants of the traced step (the trace stopped with "the example inputs may not
    match the model", from fake tensors meeting a real one)."""
    torch.manual_seed(0)
    model = _ScaledHeads()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(3)]
    loss = lambda out, target: F.cross_entropy(out, target, weight=_CLASS_WEIGHTS)  # noqa: E731
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    _matches_eager(model, loss, sgd, data, mesh_shape)


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("make", [
    lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1),
    lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)],
    ids=["adamw", "sgd"])
def test_a_parameter_the_loss_does_not_read_is_left_alone(make):
    """torch.optim skips a parameter whose grad is None; torch.func gave it zeros, and the
    update then weight-decayed it (AdamW moved it by 1.6e-3, SGD by 3e-2 in three steps).
    Its update is left out: value and state unchanged; decouple passes over it."""
    from passes.decouple import decouple
    torch.manual_seed(0)
    model = _WithUnused()
    data = _regression()
    params, _, gm, _ = _matches_eager(model, F.mse_loss, make, data, (4,))
    assert torch.equal(params["unused.weight"], model.unused.weight)
    assert "unused.weight" not in decouple(gm, ddlc.Mesh((4,)), always=True)
    assert STEP(gm).untrained == ("unused.weight", "unused.bias")


def test_an_unused_parameter_is_left_alone_under_gradient_clipping():
    """With ``clip_grad_norm`` every clipped gradient is computed from the norm, which is
    computed from the loss, the zeros of an unused parameter's too: it was weight-decayed
    and given state (AdamW moved it by 7e-2 in three steps). Clipping as
    ``clip_grad_norm_``, which leaves a gradient of None alone."""
    torch.manual_seed(0)
    model = _WithUnused()
    reference = copy.deepcopy(model)
    data = _regression()
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5)  # noqa: E731
    losses, params, _, gm = simulated(model, F.mse_loss, adamw, data, (4,), clip_grad_norm=0.01)
    want, _ = eager(reference, F.mse_loss, adamw, data, clip=0.01)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})
    assert torch.equal(params["unused.weight"], model.unused.weight)
    assert STEP(gm).untrained == ("unused.weight", "unused.bias")


class _RegisteredTwice(nn.Module):
    """One layer registered under two names (``self.b = self.a``), applied twice."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = self.a
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        return self.out(torch.relu(self.b(torch.relu(self.a(x)))))


def test_a_module_registered_under_two_names_trains_as_eager():
    """torch's functional_call gave such a module back another tensor than it had after the
    trace, which ddlc took for a forward that changes the model and refused; it is put back
    now, and the step trains as eager does (the module's parameters once, as torch lists them)."""
    torch.manual_seed(0)
    model = _RegisteredTwice()
    weight = model.a.weight
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    _matches_eager(model, F.mse_loss, sgd, _regression(), (4,))
    assert model.a.weight is weight and model.b is model.a


def _with_l2_penalty(model, strength=0.05):
    """Cross-entropy plus an L2 penalty over ``model.parameters()``, as users write it."""
    return lambda out, y: F.cross_entropy(out, y) + strength * sum((p ** 2).sum() for p in model.parameters())


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_a_loss_that_reads_the_models_parameters_trains_them(mesh_shape):
    """The loss runs with the step's parameters in the model, as the forward does: its
    penalty is a function of them (before: of constants, their values at compile, so the
    penalty never changed and gave no gradient, silently)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(3)]
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    losses, params, _, _ = simulated(model, _with_l2_penalty(model), sgd, data, mesh_shape)
    want, _ = eager(reference, _with_l2_penalty(reference), sgd, data)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})


class _NoisyMLP(nn.Module):
    """Gaussian noise on the hidden layer the way much code writes it: a fresh tensor
    filled in place (``empty_like(h).normal_(0, 0.1)``), traced as ``normal_functional``."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        return self.fc2(h + torch.empty_like(h).normal_(0.0, 0.1))


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_noise_filled_in_place_equals_single_device_with_the_same_seed(mesh_shape):
    torch.manual_seed(0)
    model = _NoisyMLP()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05)  # noqa: E731
    losses, params, _, _ = simulated(model, F.mse_loss, sgd, data, mesh_shape)
    want, _ = eager(reference, F.mse_loss, sgd, data, seed=0)  # the simulated program's seed
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})


class _FloatNorm(nn.Module):
    """An RMSNorm computing in float32 inside a float64 model (Qwen3's q_norm / k_norm)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class _NormedHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.head = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 3)
        self.q_norm, self.k_norm = _FloatNorm(8), _FloatNorm(8)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_norm(self.q(x).view(b, s, 4, 8)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, s, 4, 8)).transpose(1, 2)
        a = (q @ k.transpose(-1, -2)).softmax(-1) @ k
        return self.head(a.transpose(1, 2).reshape(b, s, 32)).mean(1)


def test_a_float64_model_with_float32_norms_runs_its_views():
    """The backward's ``_to_copy`` of the float32 norm keeps a permuted layout on the CPU
    that its meta kernel calls contiguous; a ``view`` planned from the meta strides failed
    at ``step()`` ("view size is not compatible"): views are reshapes now, a view where the
    run-time strides allow one. Three steps as eager takes them."""
    torch.manual_seed(0)
    model = _NormedHeads().double()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 6, 16, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g))
            for _ in range(3)]
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    losses, params, _, _ = simulated(model, F.cross_entropy, sgd, data, (4,))
    want, _ = eager(reference, F.cross_entropy, sgd, data)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})


def _one_hot_loss(logits, labels):
    """Binary cross-entropy against one-hot targets (F.one_hot with the class count)."""
    return F.binary_cross_entropy_with_logits(logits, F.one_hot(labels, logits.shape[-1]).float())


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_one_hot_targets_on_a_split_batch(mesh_shape):
    """``F.one_hot(labels, num_classes)`` traces (eager's kernel reads every label to check
    its range, which the trace cannot: it was refused as data-dependent control flow) and
    trains like single device with the labels split."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(3)]
    _matches_eager(model, _one_hot_loss, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), data, mesh_shape)


class _PicksByArgmax(nn.Module):
    """Adds the largest activation, and a column and a row picked by 0-d integer tensors."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(10, 6)

    def forward(self, x):
        h = self.fc(x)
        return h + h.flatten()[h.argmax()] + h[:, h.sum(0).argmin()].unsqueeze(1) + h[..., -(h.argmax() % 2) - 1, None]


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_indexing_by_a_0d_integer_tensor_trains(mesh_shape):
    """``x[i]`` with ``i`` a 0-d integer tensor reads ``i``'s value in eager (an int index),
    which one static graph cannot: it was refused as data-dependent (round W). It traces as
    ``index_select`` and trains like single device; a negative one counts from the end."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 10, generator=g), torch.randn(8, 6, generator=g)) for _ in range(3)]
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    _matches_eager(_PicksByArgmax(), F.mse_loss, sgd, data, mesh_shape)


def test_indexing_by_a_0d_integer_tensor_is_rewritten_as_eager_indexes():
    """The rewrite against eager's indexing: the tensor among slices, ints, None and ``...``,
    in every position, negative indices included."""
    from ddlc.forward_rewrites import _getitem
    x = torch.randn(3, 4, 5)
    i, j = torch.tensor(2), torch.tensor(-1)
    for index in [i, (i,), (slice(None), i), (Ellipsis, j), (None, i, 1), (j, Ellipsis, slice(1, 3)),
                  (slice(0, 3, 2), None, j, None), (1, i, slice(None)), (Ellipsis, i, None)]:
        torch.testing.assert_close(_getitem(x, index), x[index], rtol=0, atol=0, msg=str(index))


def test_one_hot_without_the_class_count_is_refused():
    """Without ``num_classes`` the count comes from the labels' values: refused at the
    user's line."""
    from ddlc.errors import UnsupportedInputError
    model = nn.Linear(8, 5)
    loss_fn = lambda out, y: F.binary_cross_entropy_with_logits(out, F.one_hot(y).float())  # noqa: E731
    with pytest.raises(UnsupportedInputError, match="num_classes") as caught:
        ddlc.trace(model, (torch.randn(4, 8), torch.tensor([0, 1, 2, 4])), loss_fn,
                   torch.optim.SGD(model.parameters(), lr=0.1))
    assert "test_training_loops.py" in str(caught.value) and "F.one_hot(y)" in str(caught.value)


class _MeanAndVariance(nn.Module):
    """A regression head predicting a mean and a variance (softplus) per output."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.mean, self.var = nn.Linear(16, 3), nn.Linear(16, 3)

    def forward(self, x):
        h = self.body(x)
        return self.mean(h), F.softplus(self.var(h))


def _gaussian_nll(out, target):
    mean, var = out
    return F.gaussian_nll_loss(mean, target, var, full=True)


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_gaussian_nll_loss_with_predicted_variances(mesh_shape):
    """``F.gaussian_nll_loss`` checks that no variance is negative by reading them (it was
    refused as data-dependent control flow); traced without the check, it trains like
    single device with the batch split."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)) for _ in range(3)]
    _matches_eager(_MeanAndVariance(), _gaussian_nll, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                   data, mesh_shape)


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
@pytest.mark.parametrize("make", [
    lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, momentum=0.9, centered=True, weight_decay=1e-2),
    lambda m: torch.optim.Adagrad([{"params": m.body.parameters()},
                                   {"params": m.head.parameters(), "lr": 0.02, "weight_decay": 0.1}],
                                  lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1),
    lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=1e-2, amsgrad=True, maximize=True),
    lambda m: torch.optim.Adadelta(m.parameters(), weight_decay=1e-2),
    lambda m: torch.optim.Adamax(m.parameters(), lr=1e-2, weight_decay=1e-2),
    lambda m: torch.optim.NAdam([{"params": m.body.parameters()},
                                 {"params": m.head.parameters(), "momentum_decay": 0.1}],
                                lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=True),
    lambda m: torch.optim.RAdam(m.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=1e-2),
], ids=["rmsprop", "adagrad", "adam-amsgrad-maximize", "adadelta", "adamax", "nadam", "radam"])
def test_each_optimizer_trains_like_single_device(make, mesh_shape):
    """RMSprop (centered, momentum, weight decay), Adagrad (two param groups, a decaying
    step size, a non-zero initial sum, which the optimizer holds from its construction),
    Adam with AMSGrad ascending, Adadelta, Adamax, NAdam (its product of momenta a scalar
    state; two groups, one with its own momentum decay) and RAdam (its betas make the
    rectified branch start at the sixth of the seven steps, so both run)."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    model.head = nn.Linear(16, 4)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(7)]
    _matches_eager(model, F.cross_entropy, make, data, mesh_shape)


class _SpectralFilter(nn.Module):
    """A learnable complex filter on each row's spectrum (``torch.fft``), then a linear head."""

    def __init__(self):
        super().__init__()
        self.filter = nn.Parameter(torch.randn(8, 5, dtype=torch.complex64) * 0.5)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        filtered = torch.fft.irfft(torch.fft.rfft(x, dim=-1) * self.filter, n=8, dim=-1)
        return self.head(filtered.mean(1))


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_a_complex_parameter_trains_with_adamw_like_single_device(mesh_shape):
    """torch.optim's Adam updates a complex parameter as its real and imaginary parts (a
    second moment per part); the update took |g|^2 of the complex gradient instead (losses
    3e-3 off from the second step)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]
    _matches_eager(_SpectralFilter(), F.cross_entropy, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                   data, mesh_shape)


class _PermutedDropout(nn.Module):
    """Dropout of activations eager lays out permuted: torch's batch-first transformer layer
    (its attention output is a transposed view) and a convolution's output read as a
    sequence (Whisper's encoder: ``conv(x).permute(0, 2, 1) + positions``)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 16, 3, padding=1)
        self.positions = nn.Parameter(torch.randn(6, 16) * 0.1)
        self.layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.3, batch_first=True)

    def forward(self, x):
        h = F.dropout(self.conv(x).permute(0, 2, 1) + self.positions, 0.2, self.training)
        return self.layer(h)


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_dropout_of_permuted_activations_draws_eagers_masks(mesh_shape):
    """Eager fills a dropout mask in its activation's memory order (``empty_like``); the
    traced graph, whose views are contiguous copies, drew it row-major: other masks (losses
    2e-2 off on the batch-first layer). The draw now follows eager's layout."""
    from ddlc.ir import DRAW_STRIDES
    torch.manual_seed(0)
    model = _PermutedDropout()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, 6, generator=g), torch.randn(8, 6, 16, generator=g)) for _ in range(3)]
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05)  # noqa: E731
    losses, params, _, gm = simulated(model, F.mse_loss, sgd, data, mesh_shape)
    assert sum(DRAW_STRIDES.has(n) for n in gm.graph.nodes) == 2  # the conv's and the attention output's
    want, _ = eager(reference, F.mse_loss, sgd, data, seed=0)  # the simulated program's seed
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_clipping_counts_a_complex_gradients_imaginary_part(mesh_shape):
    """The global norm sums ``|g|^2`` of a complex gradient, as ``clip_grad_norm_`` does;
    it took the real part alone (a norm of 2.64 for 2.71, losses 6e-3 off)."""
    torch.manual_seed(0)
    model = _SpectralFilter()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    losses, params, _, _ = simulated(model, F.cross_entropy, sgd, data, mesh_shape, clip_grad_norm=0.1)
    want, norm = eager(reference, F.cross_entropy, sgd, data, clip=0.1)
    assert norm > 0.1  # clipping is active
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})


class _SparseLookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))

    def forward(self, ids):
        return F.embedding(ids, self.table, sparse=True).sum(1)


def test_a_functional_sparse_embedding_is_refused():
    """``F.embedding(..., sparse=True)`` on a bare parameter failed inside the trace
    (``addcmul`` of a sparse tensor): refused at the user's line."""
    from ddlc.errors import UnsupportedInputError
    model = _SparseLookup()
    with pytest.raises(UnsupportedInputError, match="sparse=True") as caught:
        ddlc.trace(model, (torch.randint(0, 10, (4, 3)), torch.randn(4, 4)), F.mse_loss,
                   torch.optim.Adagrad(model.parameters()))
    assert "test_training_loops.py" in str(caught.value)


class _DropoutLayouts(nn.Module):
    """Dropout of activations laid out as eager lays them out in other ways: a permuted
    one made contiguous (row-major again), an expanded one (eager's mask is row-major
    there), a convolution's output of channels-last weights, and a transposed input."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.conv, self.conv2d = nn.Conv1d(4, 16, 3, padding=1), nn.Conv2d(3, 6, 3, padding=1)
        self.head, self.head2d, self.head_qkv = nn.Linear(16, 4), nn.Linear(6, 4), nn.Linear(16, 48)

    def forward(self, x):
        if self.variant == "contiguous":
            return self.head(F.dropout(self.conv(x).permute(0, 2, 1).contiguous(), 0.3, self.training))
        if self.variant == "expanded":
            return self.head(F.dropout(self.conv(x)[:, :1].expand(-1, 16, -1), 0.3, self.training).transpose(1, 2))
        if self.variant == "channels_last":
            return self.head2d(F.dropout(self.conv2d(x), 0.3, self.training).mean((2, 3)))
        if self.variant == "attention_output":  # on the CPU laid out as its (batch, time, head) query
            q, k, v = self.head_qkv(self.conv(x).permute(0, 2, 1)).view(8, 6, 4, 12).transpose(1, 2).chunk(3, -1)
            attended = F.dropout(F.scaled_dot_product_attention(q, k, v), 0.3, self.training)
            return self.head(attended.transpose(1, 2).reshape(8, 6, 16))
        return self.head(F.dropout(x, 0.3, self.training))  # "transposed_input"


def _layout_data(variant: str):
    g = torch.Generator().manual_seed(1)
    if variant == "channels_last":
        return [(torch.randn(8, 3, 5, 5, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]
    if variant == "transposed_input":
        return [(torch.randn(8, 16, 6, generator=g).transpose(1, 2), torch.randn(8, 6, 4, generator=g))
                for _ in range(3)]
    return [(torch.randn(8, 4, 6, generator=g), torch.randn(8, 6, 4, generator=g)) for _ in range(3)]


@pytest.mark.parametrize("variant", ["contiguous", "expanded", "channels_last", "transposed_input",
                                     "attention_output"])
def test_dropout_masks_follow_eagers_layout_in_every_form(variant):
    """A helper found these after the permuted case was fixed: ``.contiguous()`` leaves no
    node in the traced graph and an expanded dim has stride 0 (both drawn permuted:
    losses 4e-2 and 0.13 off), a channels-last convolution's output, a transposed batch and
    attention's output (laid out as its query) were drawn row-major (4e-2, 0.1, 3e-2 off). The layouts now come from the step's forward
    run eagerly, where a first look finds a mask that may be laid out otherwise."""
    torch.manual_seed(0)
    model = _DropoutLayouts(variant)
    if variant == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    _draws_match_eager(model, _layout_data(variant))


class _NoiseLayouts(nn.Module):
    """Noise drawn like a permuted activation: ``randn_like`` and ``rand_like`` of a
    channels-last convolution's output (a diffusion model's ``x + randn_like(x)``),
    ``empty_like(y).normal_()``, and ``uniform_`` of a transposed copy."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 6, 3, padding=1), nn.Linear(6, 4)

    def forward(self, x):
        y = self.conv(x)
        y = y + 0.1 * torch.randn_like(y) + 0.1 * torch.empty_like(y).normal_()
        y = y * torch.rand_like(y) + 0.1 * y.flatten(2).transpose(1, 2).clone().uniform_().transpose(1, 2).view_as(y)
        return self.head(y.mean((2, 3)))


def test_noise_drawn_like_a_permuted_activation_is_eagers():
    """Eager fills ``torch.randn_like(y)`` in ``empty_like(y)``'s memory order, and
    ``normal_`` of a tensor that is not row-major takes another algorithm than of one that
    is (other numbers, not only another order): the step drew such noise row-major (losses
    1.2e-2 off here, 0.09 and 0.16 in a helper's channels-last and transposed models). Every random fill of a
    tensor eager lays out otherwise is now drawn by eager's kernel into eager's layout."""
    torch.manual_seed(0)
    _draws_match_eager(_NoiseLayouts().to(memory_format=torch.channels_last), _layout_data("channels_last"))


class _KernelLayouts(nn.Module):
    """Random fills of tensors whose layout the fake kernels of the trace do not give:
    a transposed activation written in place (``masked_fill_``, ``index_add_``: eager keeps
    its layout, the trace has functional forms laid out row-major), batch norm of a
    transposed ``(N, C, L)`` (contiguous on the CPU, permuted in the fake kernel),
    ``copysign`` of a transposed tensor, and ``torch.normal(..., out=o)`` of a transposed
    ``o``."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 16), nn.BatchNorm1d(4)

    def forward(self, x):
        y = self.fc(x)
        z = y.t() * 1
        z.masked_fill_(z > 0.5, 0.0)
        z.index_add_(0, torch.tensor([0, 1]), torch.ones(2, x.shape[0]))
        normed = self.bn(y.view(-1, 4, 4).transpose(1, 2))
        signed = torch.copysign(y.t(), torch.ones(16, x.shape[0]))
        o = torch.empty(16, x.shape[0]).t()
        torch.normal(0.0, 1.0, (x.shape[0], 16), out=o)
        return (F.dropout(z, 0.3).t() + F.dropout(normed, 0.3).transpose(1, 2).reshape(y.shape)
                + (signed + torch.randn_like(signed)).t() + y * o)


def test_fills_laid_out_by_the_real_kernels_draw_eagers_numbers():
    """The tensors eager fills are those its real kernels lay out: the layouts are now
    recorded from the step's forward run eagerly (where a first look finds a fill that may
    be laid out otherwise than row-major), where they were the fake trace's (losses
    5e-2 to 0.6 off in a helper's reproducers)."""
    _linear_draws_match_eager(_KernelLayouts, batch=8)


class _SoftplusDropout(nn.Module):
    """Dropout of ``logaddexp(0, y.t())``: the permuted operand second, whose layout the
    meta kernel does not keep and the CPU's does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        return F.dropout(torch.logaddexp(torch.zeros(()), self.fc(x).t()), 0.3).t()


def test_a_fill_of_a_pointwise_result_laid_out_as_its_second_operand_draws_eagers_numbers():
    """The first look took the layout of a pointwise operator's first operand alone, and
    drew this mask row-major (losses 0.25 off in a helper's run)."""
    _linear_draws_match_eager(_SoftplusDropout, batch=8)


class _SetsAndRestores(nn.Module):
    """A forward that turns gradients off and sets a flag around a permuted dropout, and
    restores both after it, without ``finally``."""

    def __init__(self):
        super().__init__()
        self.fc, self.busy = nn.Linear(8, 16), False

    def forward(self, x):
        self.busy, before = True, torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        noise = F.dropout(torch.ones(16, x.shape[0]).t(), 0.5)
        torch.set_grad_enabled(before)
        self.busy = False
        return self.fc(x) * noise


def test_the_eager_run_that_records_layouts_runs_the_forward_to_its_end():
    """The eager run stopped at the last draw, so a forward restoring what it set after it
    (without ``finally``) left grad mode off in the user's process and the flag set (then
    refused as state the forward changes). It runs to the end now."""
    _linear_draws_match_eager(_SetsAndRestores, batch=8)
    assert torch.is_grad_enabled()


def test_adamw_with_its_weight_decay_coupled_trains_as_torchs():
    """``torch.optim.AdamW`` honours a group's ``decoupled_weight_decay=False`` (Adam's L2
    decay): the compiled step ran AdamW's update whatever the flag (parameters 0.04 off
    after four steps in a helper's run)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]

    def coupled(m):
        opt = torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.5)
        opt.param_groups[0]["decoupled_weight_decay"] = False
        return opt
    _matches_eager(model, F.mse_loss, coupled, data, (4,))


def _draws_match_eager(model: nn.Module, data) -> None:
    """SGD steps of ``model`` on ``data`` on simulated (2, 2) ranks match eager's, both
    seeded 0 (the simulated program's generator)."""
    reference = copy.deepcopy(model)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    losses, params, _, _ = simulated(model, F.mse_loss, sgd, data, (2, 2))
    want, _ = eager(reference, F.mse_loss, sgd, data, seed=0)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})


def _linear_draws_match_eager(model_class, batch: int) -> None:
    """:func:`_draws_match_eager` of ``model_class()`` (made after seeding 0; 8 features
    in, 16 out) on three batches of ``batch`` rows."""
    torch.manual_seed(0)
    model = model_class()
    g = torch.Generator().manual_seed(1)
    _draws_match_eager(model, [(torch.randn(batch, 8, generator=g), torch.randn(batch, 16, generator=g))
                               for _ in range(3)])


class _FillLayouts(nn.Module):
    """Random fills of tensors eager lays out otherwise than as their activation: slices of
    a larger tensor filled in place (``big[..., :8].normal_()``: not contiguous, so
    ``normal_`` draws by its serial algorithm), a gapped transposed one, a row-major mask
    multiplied into a transposed activation, ``torch.bernoulli`` of a transposed
    activation (eager fills a new row-major tensor) and ``bernoulli_`` of its clone (the
    clone's layout)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        y = self.fc(x).t()
        big = torch.zeros(16, x.shape[0], 12)
        big[..., :8].normal_()
        big[..., 8:].uniform_()
        gapped = torch.zeros(16, 2 * x.shape[0]).t()[::2].t()
        gapped.normal_()
        masks = (torch.empty(y.shape).bernoulli_(0.7) * torch.bernoulli(y.detach(), 0.4)
                 + y.clone().bernoulli_(0.6))
        return (y * masks * gapped + (big[..., :8] * big[..., 8:10].sum(-1, keepdim=True)).mean(-1)).t()


def test_fills_of_slices_and_row_major_masks_draw_eagers_numbers():
    """``normal_`` of a slice drew eager's contiguous-tensor algorithm, and every
    ``bernoulli`` took the layout of the activation it multiplies, where eager fills the
    mask's own (losses 1e-2 to 0.14 off in a helper's reproducers). Each fill now takes the
    strides of the tensor eager fills."""
    _linear_draws_match_eager(_FillLayouts, batch=4)


class _MoreDraws(nn.Module):
    """Draws that were refused (Gumbel-softmax's ``exponential_``, ``cauchy_``,
    ``geometric_``, ``log_normal_``, ``random_``, ``randint_like``, mixup's
    ``randperm``), each of a tensor laid out otherwise than row-major where it can be;
    ``randn_like`` given a ``memory_format=`` other than its input's layout; dropout under
    ``vmap`` and ``torch.bernoulli`` of an expanded tensor, which eager fills row-major."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        y = self.fc(x)
        yt = y.t()
        gumbel = F.gumbel_softmax(yt, tau=0.5, hard=True, dim=0).t()
        heavy = torch.empty_like(yt).cauchy_().clamp(-3, 3).t() + torch.empty_like(y).geometric_(0.4)
        skewed = torch.empty(16, x.shape[0]).log_normal_(0.0, 0.5).t()
        counts = (torch.empty_like(yt).random_(5).t() + torch.randint_like(yt, 2, 7).t()
                  + torch.randint_like(y, 3) + torch.empty(y.shape, dtype=torch.int64).random_() % 3)
        mixed = 0.7 * y + 0.3 * y[torch.randperm(x.shape[0])]
        square = y.view(-1, 4, 2, 2)
        noise = (torch.randn_like(yt, memory_format=torch.contiguous_format).t()
                 + torch.rand_like(square, memory_format=torch.channels_last).reshape(y.shape))
        masks = (torch.vmap(lambda r: F.dropout(r, 0.4), in_dims=1, out_dims=1, randomness="different")(y)
                 * torch.bernoulli(torch.zeros(16, 1).expand(16, x.shape[0]), 0.5).t())
        around = torch.normal(yt, 0.5).t() + torch.normal(0.2, y.abs() + 0.1) + torch.normal(y, y.abs().t().t() + 0.1)
        return mixed * gumbel + 0.1 * (heavy + skewed + counts + around) + noise + masks


def test_more_distributions_and_layouts_draw_eagers_numbers():
    """Exponential, Cauchy, geometric, log-normal and integer fills, ``randint_like``,
    ``randperm`` and ``torch.normal`` of a mean or std tensor (no gradient to either, as in
    eager) draw eager's numbers (they were refused); a ``randn_like`` given another
    ``memory_format=`` fills that layout (it took its input's: losses 0.1-0.3 off), and a
    ``bernoulli`` of an expanded tensor is not taken for dropout's mask (5e-3 to 0.17 off)."""
    _linear_draws_match_eager(_MoreDraws, batch=8)


class _MatrixTerms(torch.nn.Module):
    """Self-supervised and metric-learning terms over a split batch: a covariance's
    diagonal and off-diagonal parts (VICReg, W-MSE: ``diagonal``, ``diag_embed``, ``eye``),
    pairwise distances to prototypes (``cdist``), a log-sum-exp scan and a count of active
    units; operators that ran whole on every rank before they had rules (2026-12-06)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 5)
        self.prototypes = torch.nn.Parameter(torch.randn(7, 5))

    def forward(self, x):
        z = self.fc(x)
        centred = z - z.mean(0)
        cov = centred.T @ centred / (z.shape[0] - 1)
        off_diagonal = cov - torch.diag_embed(torch.diagonal(cov))
        distances = torch.cdist(z, self.prototypes)
        active = torch.count_nonzero(z > 0, dim=1).float()
        return (off_diagonal.pow(2).sum() + (torch.eye(5) - cov).pow(2).mean()
                + distances.logcumsumexp(1).mean() + (distances.mean(1) * active).mean() / 5)


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_covariance_and_distance_terms_train_like_single_device(mesh_shape):
    torch.manual_seed(0)
    model = _MatrixTerms()
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, 5, generator=g)) for _ in range(3)]
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)  # noqa: E731
    _, _, gm, _ = _matches_eager(model, lambda out, target: out + 0.1 * target.pow(2).mean(), adamw, data,
                                 mesh_shape)
    from passes.rules import fallback_ops  # imported on use: see conftest
    assert fallback_ops(gm) == []


class _ForwardTransform(nn.Module):
    """A model whose forward calls a reverse-mode torch.func transform of its own."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.embed = nn.Linear(16, 4)
        self.f = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x):
        h = self.embed(x)
        if self.kind == "maml":  # one inner gradient step on the first samples, then the batch
            params = dict(self.f.named_parameters())
            grads = torch.func.grad(lambda p: torch.func.functional_call(self.f, p, (h[:4],)).pow(2).mean())(params)
            return torch.func.functional_call(self.f, {k: v - 0.5 * grads[k] for k, v in params.items()}, (h,))
        if self.kind == "grad":
            g = torch.func.vmap(torch.func.grad(lambda r: self.f(r).sum()))(h)
        elif self.kind == "vjp":
            out, pull = torch.func.vjp(self.f, h)
            (g,) = pull(torch.ones_like(out))
        else:
            g = torch.func.vmap(torch.func.jacrev(self.f))(h).diagonal(dim1=1, dim2=2)
        return self.f(h) + 0.1 * g


@pytest.mark.parametrize("kind", ["grad", "vjp", "jacrev", "maml"])
@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_torch_func_transforms_inside_the_forward_train_like_single_device(kind, mesh_shape):
    """``torch.func.grad``, ``vjp`` and ``jacrev`` called by the forward (a MAML inner step
    over the module's own parameters; an input-gradient term) train as in eager. Their
    transforms mark their inputs with ``requires_grad_`` at a level of their own, which the
    trace's rewrite of that call (a no-op at the step's level) had swallowed: their
    gradients came out as zeros and the losses differed from eager's from the first step."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]
    _matches_eager(_ForwardTransform(kind), F.mse_loss, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                   data, mesh_shape)


def test_sgd_dampening_without_momentum_trains_like_single_device():
    """torch.optim.SGD ignores ``dampening`` without momentum: such an optimizer trains as
    in eager (it was refused as if it damped; with momentum it still is, tests/test_trace.py)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)) for _ in range(3)]
    _matches_eager(zoo.MLP(), F.mse_loss, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, dampening=0.5),
                   data, (4,))


def test_rrelu_in_eval_mode_trains_like_single_device():
    """``nn.RReLU`` in eval mode is a leaky ReLU of the mean slope and draws nothing: it
    trains as in eager (its op, tagged random, was refused as a draw). In training mode it
    draws per element, which ddlc does not reproduce: still refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.RReLU(0.1, 0.3), nn.Linear(32, 4))
    model[1].eval()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]
    _matches_eager(model, F.mse_loss, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), data, (4,))
    model[1].train()
    with pytest.raises(ddlc.errors.UnsupportedInputError, match="rrelu"):
        ddlc.trace(model, data[0], F.mse_loss, torch.optim.Adam(model.parameters(), lr=1e-2))


class _InferenceModeTeacher(nn.Module):
    """A forward that computes part of its output under ``torch.inference_mode()``, in a
    block and in a decorated helper (an EMA teacher's targets, written so)."""

    def __init__(self):
        super().__init__()
        self.teacher, self.student = nn.Linear(16, 4), nn.Linear(16, 4)

    @torch.inference_mode()
    def targets(self, x):
        return self.teacher(x)

    def forward(self, x):
        with torch.inference_mode():
            weights = self.teacher(x).softmax(-1)
        return self.student(x) * 0.5 + weights - self.targets(x)


def test_inference_mode_inside_the_forward_trains_like_single_device():
    """``torch.inference_mode()`` inside the forward is traced as ``torch.no_grad()``: the
    same values, no gradient (the teacher's parameters get none, and AdamW leaves them as
    eager's does). Real inference mode made the trace's fake tensors inference tensors,
    and the trace failed ("Cannot set version_counter for inference tensor")."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]
    _matches_eager(_InferenceModeTeacher(), F.mse_loss, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                   data, (2, 2))


class _HookedForward(nn.Module):
    """A forward that registers a hook as it runs (``kind``), beside a count buffer it
    increments."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        with torch.no_grad():
            self.count.add_(1)
        h = h * 1.0
        if self.kind == "count bound":   # the hook reads the value bound in the forward
            count = self.count.clone()
            h.register_hook(lambda g: g * count)
        elif self.kind == "weight bound":
            bias = self.fc2.bias
            h.register_hook(lambda g: g * bias.sum())
        elif self.kind == "count read in backward":
            h.register_hook(lambda g: g * self.count)
        elif self.kind == "weight read in backward":
            h.register_hook(lambda g: g * self.fc2.bias.sum())
        elif self.kind == "on a parameter":
            self.fc1.weight.register_hook(lambda g: g * 2)
        elif self.kind == "post-accumulate":
            self.fc1.weight.register_post_accumulate_grad_hook(lambda p: None)
        elif self.kind == "module backward":
            self.fc2.register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 3,))
        elif self.kind == "retain_grad":
            h.retain_grad()
        return self.fc2(h)


def _hook_data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]


@pytest.mark.parametrize("kind", ["count bound", "weight bound", "count read in backward", "weight read in backward",
                                  "retain_grad"])
def test_a_gradient_hook_registered_in_the_forward_trains_like_single_device(kind):
    """A hook on an activation's gradient registered by the forward, reading values the
    forward bound, or reading a buffer the forward increments or a weight through the
    module when the backward runs, trains as in eager; so does a forward that calls
    ``h.retain_grad()`` (torch.func refused it: the trace failed). Read in the backward,
    the real tensor was a constant of its value at compile: the count's hook multiplied
    the gradient by 0 where eager's did by 1, 2, 3, silently, and the weight's was
    refused; such a read is now the step's value (the parameter, the buffer's updated
    value)."""
    torch.manual_seed(0)
    _matches_eager(_HookedForward(kind), F.mse_loss, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                   _hook_data(), (2, 2))


@pytest.mark.parametrize("kind, cause", [
    ("on a parameter", "registers a hook on a parameter's gradient"),
    ("post-accumulate", "registers a post-accumulate-grad hook"),
    ("module backward", "registers a backward hook on a module"),
])
def test_hooks_the_trace_cannot_reproduce_are_refused_with_the_cause(kind, cause):
    """What eager does with these hooks, one traced step does not: a hook registered on a
    parameter stays there in eager (one more at every call; registered once, lazily, it
    would match, and is refused all the same); post-accumulate hooks run as ``.grad``
    fills, which the traced step has none of; a module backward hook registered in the
    forward was refused as torch.distributions' sampling."""
    model = _HookedForward(kind)
    with pytest.raises(ddlc.errors.UnsupportedInputError, match=cause) as info:
        ddlc.trace(model, _hook_data()[0], F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "test_training_loops.py" in str(info.value)


def test_a_buffer_the_step_updates_read_by_the_loss_through_a_reference_is_refused():
    """A reference to a buffer kept before compile and read by the loss holds the real
    buffer, a constant of its value at compile, where eager reads the value the forward
    left in it."""
    model = _HookedForward("none")
    count = model.count
    with pytest.raises(ddlc.errors.UnsupportedInputError, match="reads buffer 'count', which it updates"):
        ddlc.trace(model, _hook_data()[0], lambda out, y: F.mse_loss(out, y) * count,
                   torch.optim.SGD(model.parameters(), lr=0.1))


def _one_element_loss(out, target):
    """A loss of shape ``(1,)``, as code written for ``nn.DataParallel`` returns it (eager's
    ``backward()`` takes any one-element loss)."""
    return F.mse_loss(out, target).unsqueeze(0)


def _one_element_loss_data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)) for _ in range(3)]


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_a_loss_of_shape_one_trains_as_eager(mesh_shape):
    """It is traced as the 0-d loss torch.func takes (it was refused as if the example
    inputs did not fit the model)."""
    torch.manual_seed(0)
    model = zoo.MLP()
    reference = copy.deepcopy(model)
    losses, params, _, _ = simulated(model, _one_element_loss, _adamw, _one_element_loss_data(), mesh_shape)
    want, _ = eager(reference, _one_element_loss, _adamw, _one_element_loss_data())
    assert_matches_reference({"losses": torch.stack(losses), "params": params},
                             {"losses": torch.cat(want), "params": dict(reference.named_parameters())})


def _one_element_loss_steps(rank):
    torch.manual_seed(0)
    model = zoo.MLP()
    data = _one_element_loss_data()
    step = ddlc.compile(model, (1,), data[0], loss_fn=_one_element_loss, optimizer=_adamw(model))
    return [step.step(*batch) for batch in data]


@pytest.mark.multiprocess
def test_step_returns_a_loss_of_shape_one_in_its_shape():
    got = spawn(_one_element_loss_steps, 1, timeout=60, deadline=100)[0]
    torch.manual_seed(0)
    want, _ = eager(zoo.MLP(), _one_element_loss, _adamw, _one_element_loss_data())
    assert [loss.shape for loss in got] == [torch.Size([1])] * 3
    torch.testing.assert_close(torch.cat(got), torch.cat(want))


class _TutorialTransformerLM(nn.Module):
    """The "Language Modeling with nn.Transformer" tutorial's model: sequence-first, its
    causal mask built in forward and given to the encoder without ``is_causal``."""

    def __init__(self, tokens=50, width=32):
        super().__init__()
        self.embedding = nn.Embedding(tokens, width)
        layer = nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.decoder = nn.Linear(width, tokens)
        self.width = width

    def forward(self, src):
        mask = nn.Transformer.generate_square_subsequent_mask(len(src))
        return self.decoder(self.encoder(self.embedding(src) * self.width ** 0.5, mask))


def test_a_transformer_given_a_causal_mask_without_is_causal_trains_like_eager():
    """``nn.TransformerEncoder`` compares a mask given without ``is_causal`` with a causal
    mask to choose its kernel, a value check the trace refused (a generic data-dependent
    control flow error); the mask is taken as given now, which computes the same."""
    torch.manual_seed(0)
    model = _TutorialTransformerLM()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 50, (10, 8), generator=g), torch.randint(0, 50, (10, 8), generator=g))
            for _ in range(3)]
    loss = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    losses, params, _, _ = simulated(model, loss, sgd, data, (4,), batch_sbp="(S1)")
    want, _ = eager(reference, loss, sgd, data)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})


class _ManualNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def _manual_sgd_data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(4)]


def _manual_sgd_steps(rank):
    """Both forms of :func:`_manual_sgd_loop`: through ``.data``, under ``no_grad``."""
    return [_manual_sgd_loop(through_data) for through_data in (True, False)]


def _manual_sgd_loop(through_data):
    """word_language_model's loop: no optimizer, each weight updated by hand from the
    step's gradients, through ``.data`` or under ``no_grad``."""
    torch.manual_seed(0)
    model = _ManualNet()
    step = ddlc.compile(model, (4,), _manual_sgd_data()[0], F.mse_loss)
    losses = []
    for x, y in _manual_sgd_data():
        losses.append(float(step.step(x, y)))
        for name, grad in step.gradients().items():
            param = dict(model.named_parameters())[name]
            if through_data:
                param.data.add_(grad, alpha=-0.5)
            else:
                with torch.no_grad():
                    param.add_(grad, alpha=-0.5)
    from_step = step.state_dict()  # the weights the loop wrote since the last step too
    step.write_back()  # the running statistics; the weights are the model's own
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(from_step[k], v) for k, v in state.items())
    return losses, state


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_step_without_optimizer_reads_the_weights_a_loop_updates_by_hand():
    """A step compiled without an optimizer changes no weight, so it reads the model's at
    each step, as eager's backward does. It held a copy taken at compile: an update through
    ``.data`` was silently ignored (every loss the untrained model's), one under ``no_grad``
    refused. ``write_back`` puts back the running statistics and leaves the weights."""
    got = [run for rank_runs in spawn(_manual_sgd_steps, 4, timeout=150, deadline=190) for run in rank_runs]
    torch.manual_seed(0)
    model, losses = _ManualNet(), []
    for x, y in _manual_sgd_data():
        model.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.5)
        losses.append(float(loss.detach()))
    for rank_losses, state in got:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=key)


class _ActorCritic(nn.Module):
    """A shared trunk, a policy head and a value head; an actor-critic loss over given
    actions and returns with ``torch.distributions.Categorical`` made as RL code makes it
    (``validate_args`` left to its default), with an entropy bonus."""

    def __init__(self):
        super().__init__()
        self.trunk, self.policy, self.value = nn.Linear(6, 16), nn.Linear(16, 4), nn.Linear(16, 1)

    def forward(self, obs, actions, returns):
        h = torch.tanh(self.trunk(obs))
        dist = torch.distributions.Categorical(logits=self.policy(h))
        value = self.value(h).squeeze(-1)
        advantage = (returns - value).detach()
        return {"loss": -(dist.log_prob(actions) * advantage).mean() - 0.01 * dist.entropy().mean()
                + F.mse_loss(value, returns)}


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=["4", "2x2"])
def test_distributions_checking_their_values_by_default_train_like_single_device(mesh_shape, monkeypatch):
    """torch.distributions checks its arguments' values by default (``validate_args``),
    reading them into Python: such a distribution was refused, naming
    ``validate_args=False``. Traced without the check (as torch.compile does), an
    actor-critic's ``Categorical(logits=...).log_prob(actions)`` trains as eager."""
    monkeypatch.setattr(torch.distributions.Distribution, "_validate_args", True)  # torch.compile turns it off
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [{"obs": torch.randn(8, 6, generator=g), "actions": torch.randint(0, 4, (8,), generator=g),
             "returns": torch.randn(8, generator=g)} for _ in range(3)]
    model = _ActorCritic()
    reference = copy.deepcopy(model)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    losses, params, _, _ = simulated(model, None, sgd, data, mesh_shape)
    assert torch.distributions.Distribution._validate_args  # as it was
    want, _ = eager(reference, None, sgd, data)
    assert_matches_reference({"losses": losses, "params": params},
                             {"losses": want, "params": dict(reference.named_parameters())})


def _pruned():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    torch.nn.utils.prune.l1_unstructured(model[0], "weight", amount=0.3)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(2)]
    return model, data


def _pruned_runs(rank):
    """A pruned model's inference program, then two training steps and a write-back: the
    outputs, and the pruned weight attribute with the weights it should be computed from."""
    model, data = _pruned()
    outputs = ddlc.compile(model, (2,), data[0][:1])(data[0][0])
    step = ddlc.compile(model, (2,), data[0], F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in data:
        step.step(x, y)
    step.write_back()
    layer = model[0]
    return outputs, layer.weight.detach().clone(), (layer.weight_orig * layer.weight_mask).detach()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_pruned_model_runs_inference_and_its_pruned_weight_follows_the_training():
    """``nn.utils.prune``'s forward pre-hook sets ``weight = weight_orig * weight_mask`` at
    every call. An inference program of a pruned model was refused as a forward changing
    an attribute at every call (round AF); it runs now. After ``write_back`` the attribute
    kept its value at compile, which the next pruning round ranks entries by; it is computed
    from the trained weights now."""
    outputs, attribute, trained = spawn(_pruned_runs, 2, timeout=100, deadline=110)[0]
    model, data = _pruned()
    with torch.no_grad():
        torch.testing.assert_close(outputs, model(data[0][0]))
    torch.testing.assert_close(attribute, trained)
    assert not torch.allclose(attribute, model[0].weight)  # the weights at compile
