"""Small reference models shared by the examples, tests and benchmarks.

Each model is an ordinary single-device ``nn.Module``; nothing in it knows
about ddlc. ``example_batch`` helpers build deterministic inputs.
"""
from __future__ import annotations

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Linear -> GELU -> Linear, a stack of ``depth`` such blocks."""

    def __init__(self, d_in: int = 32, d_hidden: int = 64, d_out: int = 16, depth: int = 2):
        super().__init__()
        dims = [d_in] + [d_hidden] * (depth - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = F.gelu(x)
        return x


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT-2-style decoder: token + position embedding, pre-LN blocks, LM head. With
    ``checkpoint``, each block runs under ``torch.utils.checkpoint`` while training
    (activation checkpointing: its activations are recomputed in backward)."""

    def __init__(self, vocab: int = 64, d_model: int = 32, n_heads: int = 4, n_layers: int = 2,
                 seq_len: int = 16, tied: bool = False, checkpoint: bool = False):
        super().__init__()
        self.checkpoint = checkpoint
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        self.register_buffer("positions", torch.arange(seq_len), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(self.positions[: idx.shape[1]])
        for block in self.blocks:
            if self.checkpoint and self.training:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))


class CNN(nn.Module):
    """conv -> relu -> maxpool -> conv -> relu -> avgpool -> linear."""

    def __init__(self, channels: int = 3, n_classes: int = 10, width: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc = nn.Linear(2 * width * 4 * 4, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.adaptive_avg_pool2d(F.relu(self.conv2(x)), 4)
        return self.fc(x.flatten(1))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy for (batch, seq, vocab) logits."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --------------------------------------------------------------------------------------
# The torchvision CNNs the seed papers evaluate on (ResNet-18/50, VGG-16-BN, MobileNetV2),
# re-implemented in plain torch.nn (no torchvision import). Layer structure, module names
# (so ``state_dict`` keys match torchvision's), in-place activations and weight
# initialisation follow torchvision's ``resnet.py``, ``vgg.py`` and ``mobilenetv2.py``;
# a width argument shrinks the channels for tests. At the default width and
# ``num_classes=1000`` the parameter counts equal torchvision's.
# --------------------------------------------------------------------------------------


def _conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution, padding 1, no bias (torchvision's ``conv3x3``)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution, no bias (torchvision's ``conv1x1``)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """ResNet-18/34 block: conv3x3(stride) -> BN -> ReLU -> conv3x3 -> BN, plus the identity
    (or ``downsample(x)``), then ReLU. ``expansion = 1``."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    """ResNet-50/101/152 block (v1.5, as torchvision: the stride sits on the 3x3 conv):
    conv1x1 -> BN -> ReLU -> conv3x3(stride) -> BN -> ReLU -> conv1x1 (x4 channels) -> BN,
    plus the identity (or ``downsample(x)``), then ReLU. ``expansion = 4``."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet (He et al. 2015, v1.5).

    Stem: conv7x7 stride 2 (3 -> ``width``) -> BN -> ReLU -> maxpool 3x3 stride 2; then four
    stages ``layer1..layer4`` of ``block`` with ``width, 2*width, 4*width, 8*width`` planes,
    the first block of stages 2-4 striding by 2; a block whose stride or channel count
    changes gets a ``downsample`` of conv1x1(stride) -> BN on its shortcut. Head: adaptive
    average pool to 1x1 -> flatten -> ``fc`` Linear(8*width*expansion, num_classes).

    Init as torchvision: convs ``kaiming_normal_(mode="fan_out", nonlinearity="relu")``,
    BN weight 1 and bias 0, ``fc`` PyTorch's default Linear init; with
    ``zero_init_residual`` the last BN of each block starts at weight 0.
    """

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: list[int], num_classes: int = 1000,
                 width: int = 64, zero_init_residual: bool = False):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, 2 * width, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 4 * width, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 8 * width, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width * block.expansion, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.constant_(m.bn3.weight, 0)
                elif isinstance(m, BasicBlock):
                    nn.init.constant_(m.bn2.weight, 0)

    def _make_layer(self, block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(_conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 10, width: int = 64, zero_init_residual: bool = False) -> ResNet:
    """ResNet-18: :class:`ResNet` of :class:`BasicBlock` with stages [2, 2, 2, 2].

    ``width=64, num_classes=1000`` is torchvision's ``resnet18()`` (11,689,512 parameters).
    """
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, width, zero_init_residual)


def resnet50(num_classes: int = 10, width: int = 64, zero_init_residual: bool = False) -> ResNet:
    """ResNet-50: :class:`ResNet` of :class:`Bottleneck` with stages [3, 4, 6, 3].

    ``width=64, num_classes=1000`` is torchvision's ``resnet50()`` (25,557,032 parameters).
    """
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, width, zero_init_residual)


#: torchvision's VGG configuration "D" (VGG-16): conv output channels at width 64, "M" a 2x2 max pool.
VGG16_CFG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG(nn.Module):
    """torchvision's VGG (Simonyan & Zisserman 2014) with batch norm.

    ``features``: for each entry of ``cfg`` a conv3x3 (padding 1, with bias) -> BN -> ReLU,
    channels scaled by ``width / 64``, or for "M" a 2x2 max pool stride 2. Then
    ``avgpool`` adaptive average pool to ``pool x pool``, flatten, and ``classifier``:
    Linear(C*pool*pool, hidden) -> ReLU -> Dropout(dropout) -> Linear(hidden, hidden) ->
    ReLU -> Dropout(dropout) -> Linear(hidden, num_classes).

    Init as torchvision: convs ``kaiming_normal_(mode="fan_out", nonlinearity="relu")``
    with bias 0, BN weight 1 and bias 0, Linears ``normal_(0, 0.01)`` with bias 0.
    """

    def __init__(self, cfg=VGG16_CFG, num_classes: int = 1000, width: int = 64, pool: int = 7,
                 hidden: int = 4096, dropout: float = 0.5):
        super().__init__()
        layers: list[nn.Module] = []
        in_channels = 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                out_channels = v * width // 64
                layers += [nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
                           nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True)]
                in_channels = out_channels
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((pool, pool))
        self.classifier = nn.Sequential(
            nn.Linear(in_channels * pool * pool, hidden), nn.ReLU(True), nn.Dropout(p=dropout),
            nn.Linear(hidden, hidden), nn.ReLU(True), nn.Dropout(p=dropout),
            nn.Linear(hidden, num_classes))

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def vgg16_bn(num_classes: int = 10, width: int = 64, image_size: int = 32, dropout: float = 0.5,
             hidden: int | None = None) -> VGG:
    """VGG-16 with batch norm: :class:`VGG` over config "D" (13 convs in 5 blocks, 3 Linears).

    The five max pools divide the image by 32, so the average pool is to
    ``max(1, image_size // 32)`` squared (7x7 for 224, 1x1 for 32: no-op on CIFAR-size
    images); the classifier's hidden size is ``hidden`` or ``64 * width`` (4096 at width 64).
    ``vgg16_bn(1000, image_size=224)`` is torchvision's ``vgg16_bn()`` (138,365,992
    parameters). Any input size still works: the pool is adaptive.
    """
    return VGG(VGG16_CFG, num_classes, width, pool=max(1, image_size // 32),
               hidden=64 * width if hidden is None else hidden, dropout=dropout)


def _make_divisible(v: float, divisor: int, min_value: int | None = None) -> int:
    """torchvision's rounding of a channel count to a multiple of ``divisor``, never more
    than 10% below ``v`` (from the original TensorFlow MobileNet code)."""
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


def _conv_bn_relu6(in_planes: int, out_planes: int, kernel_size: int = 3, stride: int = 1,
                   groups: int = 1) -> nn.Sequential:
    """Conv (no bias, "same" padding) -> BN -> ReLU6: torchvision's ``Conv2dNormActivation``
    with ``activation_layer=nn.ReLU6`` (a Sequential, so the state-dict keys match)."""
    return nn.Sequential(
        nn.Conv2d(in_planes, out_planes, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out_planes), nn.ReLU6(inplace=True))


class InvertedResidual(nn.Module):
    """MobileNetV2 block: [1x1 expand conv -> BN -> ReLU6, when ``expand_ratio != 1``] ->
    3x3 depthwise conv(stride, groups=hidden) -> BN -> ReLU6 -> 1x1 linear projection -> BN;
    the input is added back when ``stride == 1`` and the channel count is unchanged."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int):
        super().__init__()
        assert stride in (1, 2)
        self.stride = stride
        hidden_dim = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(_conv_bn_relu6(inp, hidden_dim, kernel_size=1))
        layers += [_conv_bn_relu6(hidden_dim, hidden_dim, stride=stride, groups=hidden_dim),
                   nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
                   nn.BatchNorm2d(oup)]
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


#: torchvision's MobileNetV2 table: expansion t, output channels c, repeats n, first stride s.
MOBILENET_V2_SETTING = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                        (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


class MobileNetV2(nn.Module):
    """torchvision's MobileNetV2 (Sandler et al. 2018).

    ``features``: conv3x3 stride 2 (3 -> 32) -> BN -> ReLU6; the :class:`InvertedResidual`
    blocks of :data:`MOBILENET_V2_SETTING`; conv1x1 -> BN -> ReLU6 to 1280 channels. Every
    channel count is scaled by ``width_mult`` and rounded by :func:`_make_divisible` to a
    multiple of ``round_nearest`` (the last one only ever scaled up). Then adaptive average
    pool to 1x1, flatten, and ``classifier``: Dropout(dropout) -> Linear(last, num_classes).

    Init as torchvision: convs ``kaiming_normal_(mode="fan_out")``, BN weight 1 and bias 0,
    Linear ``normal_(0, 0.01)`` with bias 0.
    """

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.2,
                 round_nearest: int = 8, inverted_residual_setting=MOBILENET_V2_SETTING):
        super().__init__()
        input_channel = _make_divisible(32 * width_mult, round_nearest)
        self.last_channel = _make_divisible(1280 * max(1.0, width_mult), round_nearest)
        features: list[nn.Module] = [_conv_bn_relu6(3, input_channel, stride=2)]
        for t, c, n, s in inverted_residual_setting:
            output_channel = _make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                features.append(InvertedResidual(input_channel, output_channel, s if i == 0 else 1, t))
                input_channel = output_channel
        features.append(_conv_bn_relu6(input_channel, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(self.last_channel, num_classes))

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v2(num_classes: int = 10, width_mult: float = 1.0, dropout: float = 0.2) -> MobileNetV2:
    """MobileNetV2 (:class:`MobileNetV2`); ``width_mult`` scales the channels (0.25 for tiny
    test versions). ``mobilenet_v2(1000)`` is torchvision's ``mobilenet_v2()`` (3,504,872
    parameters)."""
    return MobileNetV2(num_classes, width_mult, dropout)
