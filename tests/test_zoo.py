"""The torchvision-style CNNs of ddlc.zoo (ResNet-18/50, VGG-16-BN, MobileNetV2): shapes
in train and eval mode, torchvision's parameter counts and state-dict names at the
default widths, BatchNorm running statistics, gradients for every parameter and the
torchvision initialisation. Forward/backward runs use tiny widths so the file stays fast.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ddlc.zoo import (InvertedResidual, _make_divisible, mobilenet_v2, resnet18, resnet50,
                      vgg16_bn)

NUM_CLASSES = 10

#: Tiny versions for forward/backward tests.
TINY = {
    "resnet18": lambda: resnet18(NUM_CLASSES, width=8),
    "resnet50": lambda: resnet50(NUM_CLASSES, width=8),
    "vgg16_bn": lambda: vgg16_bn(NUM_CLASSES, width=8),
    "mobilenet_v2": lambda: mobilenet_v2(NUM_CLASSES, width_mult=0.25),
}

#: torchvision's default construction (num_classes=1000) and its parameter count.
TORCHVISION = {
    "resnet18": (lambda: resnet18(1000), 11_689_512),
    "resnet50": (lambda: resnet50(1000), 25_557_032),
    "vgg16_bn": (lambda: vgg16_bn(1000, image_size=224), 138_365_992),
    "mobilenet_v2": (lambda: mobilenet_v2(1000), 3_504_872),
}

#: A few state-dict keys of torchvision's models, so its checkpoints load by name.
TORCHVISION_KEYS = {
    "resnet18": ["conv1.weight", "bn1.running_mean", "layer1.0.conv1.weight", "layer1.1.bn2.bias",
                 "layer2.0.downsample.0.weight", "layer2.0.downsample.1.running_var",
                 "layer4.1.conv2.weight", "fc.weight", "fc.bias"],
    "resnet50": ["layer1.0.conv3.weight", "layer1.0.bn3.weight", "layer1.0.downsample.0.weight",
                 "layer3.5.conv2.weight", "layer4.2.bn3.num_batches_tracked", "fc.weight"],
    "vgg16_bn": ["features.0.weight", "features.0.bias", "features.1.running_var", "features.40.weight",
                 "features.41.bias", "classifier.0.weight", "classifier.3.weight", "classifier.6.bias"],
    "mobilenet_v2": ["features.0.0.weight", "features.0.1.weight", "features.1.conv.0.0.weight",
                     "features.1.conv.1.weight", "features.1.conv.2.running_mean",
                     "features.2.conv.0.0.weight", "features.2.conv.3.weight", "features.17.conv.3.bias",
                     "features.18.0.weight", "features.18.1.bias", "classifier.1.weight"],
}

NAMES = list(TINY)


def _tiny(name: str) -> nn.Module:
    torch.manual_seed(0)
    return TINY[name]()


def _images(batch: int = 2, size: int = 32) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


def _bns(model: nn.Module) -> list[nn.BatchNorm2d]:
    return [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", NAMES)
def test_output_shape(name, train):
    model = _tiny(name).train(train)
    with torch.no_grad():
        out = model(_images())
    assert out.shape == (2, NUM_CLASSES)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", NAMES)
def test_parameter_count_matches_torchvision(name):
    build, expected = TORCHVISION[name]
    with torch.device("meta"):
        model = build()
    assert sum(p.numel() for p in model.parameters()) == expected
    keys = model.state_dict().keys()
    missing = [k for k in TORCHVISION_KEYS[name] if k not in keys]
    assert not missing, f"torchvision state-dict keys missing: {missing}"


def test_vgg_small_image_defaults():
    """At image_size 32 the pool is 1x1 and the hidden size 64 * width."""
    model = vgg16_bn(NUM_CLASSES, width=8)
    assert model.avgpool.output_size == (1, 1)
    linears = [m for m in model.classifier if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 512), (512, 512), (512, NUM_CLASSES)]
    assert [m.p for m in model.classifier if isinstance(m, nn.Dropout)] == [0.5, 0.5]
    assert sum(isinstance(m, nn.Conv2d) for m in model.features) == 13
    assert sum(isinstance(m, nn.MaxPool2d) for m in model.features) == 5
    big = vgg16_bn(NUM_CLASSES, width=8, image_size=224, dropout=0.1)
    assert big.avgpool.output_size == (7, 7) and big.classifier[2].p == 0.1


def test_resnet_structure():
    r18, r50 = resnet18(NUM_CLASSES, width=8), resnet50(NUM_CLASSES, width=8)
    assert [len(getattr(r18, f"layer{i}")) for i in range(1, 5)] == [2, 2, 2, 2]
    assert [len(getattr(r50, f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]
    assert sum(isinstance(m, nn.Conv2d) for m in r18.modules()) == 20  # 1 + 16 + 3 downsample
    assert sum(isinstance(m, nn.Conv2d) for m in r50.modules()) == 53  # 1 + 48 + 4 downsample
    assert r18.fc.in_features == 64 and r50.fc.in_features == 256
    assert r18.layer1[0].downsample is None and r50.layer1[0].downsample is not None
    assert r18.layer2[0].downsample[0].stride == (2, 2) and r50.layer2[0].conv2.stride == (2, 2)


def test_mobilenet_v2_structure():
    assert [_make_divisible(v, 8) for v in (8, 4, 6, 8.0, 24, 80, 1280)] == [8, 8, 8, 8, 24, 80, 1280]
    model = mobilenet_v2(NUM_CLASSES, width_mult=0.25, dropout=0.3)
    blocks = [m for m in model.features if isinstance(m, InvertedResidual)]
    assert len(blocks) == 17
    # at width 0.25 the first block (8 -> 8 channels, stride 1) has a residual too
    assert [b.use_res_connect for b in blocks].count(True) == 11
    with torch.device("meta"):
        full = mobilenet_v2(1000)
    assert [m.use_res_connect for m in full.features if isinstance(m, InvertedResidual)].count(True) == 10
    depthwise = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
    assert len(depthwise) == 17 and all(m.groups == m.in_channels == m.out_channels for m in depthwise)
    assert any(isinstance(m, nn.ReLU6) for m in model.modules())
    assert model.last_channel == 1280 and model.classifier[0].p == 0.3
    assert mobilenet_v2(NUM_CLASSES).features[0][0].out_channels == 32


@pytest.mark.parametrize("name", NAMES)
def test_batchnorm_running_stats(name):
    model = _tiny(name)
    bns = _bns(model)
    assert bns
    before = [(bn.running_mean.clone(), bn.running_var.clone()) for bn in bns]
    model.train()
    with torch.no_grad():
        model(_images())
    for bn, (mean, var) in zip(bns, before):
        assert bn.num_batches_tracked.item() == 1
        assert not torch.equal(bn.running_mean, mean) and not torch.equal(bn.running_var, var)
    after = [(bn.running_mean.clone(), bn.running_var.clone()) for bn in bns]
    model.eval()
    with torch.no_grad():
        first = model(_images())
        second = model(_images())
    assert torch.equal(first, second)  # no dropout, no batch statistics
    for bn, (mean, var) in zip(bns, after):
        assert bn.num_batches_tracked.item() == 1
        assert torch.equal(bn.running_mean, mean) and torch.equal(bn.running_var, var)


@pytest.mark.parametrize("name", NAMES)
def test_backward_reaches_every_parameter(name):
    """64x64 images: at 32x32 the last stages are 1x1, where a train-mode BN (2 values per
    channel) removes any per-channel shift, so e.g. MobileNetV2's late projection-BN biases
    get an exactly zero gradient (torchvision's model does the same)."""
    model = _tiny(name).train()
    loss = nn.functional.cross_entropy(model(_images(size=64)), torch.tensor([1, 7]))
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", NAMES)
def test_torchvision_init(name):
    model = _tiny(name)
    for bn in _bns(model):
        assert torch.equal(bn.weight, torch.ones_like(bn.weight))
        assert torch.equal(bn.bias, torch.zeros_like(bn.bias))
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    # kaiming_normal_(mode="fan_out", relu): std sqrt(2 / fan_out), fan_out = out/groups * kh * kw
    big = max(convs, key=lambda m: m.weight.numel())
    fan_out = big.out_channels // big.groups * big.kernel_size[0] * big.kernel_size[1]
    assert big.weight.std().item() == pytest.approx(math.sqrt(2 / fan_out), rel=0.1)
    assert all(m.bias is None or not m.bias.any() for m in convs)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if name.startswith("resnet"):  # torchvision keeps PyTorch's default Linear init for fc
        bound = 1 / math.sqrt(model.fc.in_features)
        assert model.fc.weight.abs().max() <= bound and model.fc.bias.abs().max() <= bound
        assert model.fc.bias.any()
    else:  # normal(0, 0.01), bias 0
        for m in linears:
            assert m.weight.std().item() == pytest.approx(0.01, rel=0.15)
            assert not m.bias.any()


def test_zero_init_residual():
    for model in (resnet18(NUM_CLASSES, width=8, zero_init_residual=True),
                  resnet50(NUM_CLASSES, width=8, zero_init_residual=True)):
        last = [getattr(b, "bn3", None) or b.bn2 for layer in (model.layer1, model.layer4) for b in layer]
        assert all(not bn.weight.any() for bn in last)
