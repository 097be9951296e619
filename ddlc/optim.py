"""Functional optimizer updates that trace into the step graph.

Each spec mirrors one ``torch.optim`` class (single-tensor CPU path) as pure
tensor arithmetic, so the update appears in the graph as ordinary aten ops
whose inputs are the parameter, its gradient and its state tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from .errors import UnsupportedInputError

__all__ = ["OptimizerSpec", "SGDSpec", "AdamWSpec", "optimizer_spec", "hyperparameters"]


class OptimizerSpec:
    """Hyper-parameters of one parameter's update and the names of its state tensors."""

    state_names: tuple[str, ...] = ()

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def update(self, param, grad, state: Mapping[str, torch.Tensor]):
        """Return ``(new_param, new_state)``; never mutates its inputs."""
        raise NotImplementedError


@dataclass(frozen=True)
class SGDSpec(OptimizerSpec):
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()

    def init_state(self, param):
        # torch starts the buffer as a copy of the first gradient; a zero buffer
        # gives the identical first step when dampening is 0 (momentum*0 + g).
        return {name: torch.zeros_like(param) for name in self.state_names}

    def update(self, param, grad, state):
        if self.weight_decay:
            grad = grad.add(param, alpha=self.weight_decay)
        new_state = {}
        if self.momentum:
            buf = state["momentum_buffer"].mul(self.momentum).add(grad)
            new_state["momentum_buffer"] = buf
            grad = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
        return param.add(grad, alpha=-self.lr), new_state


@dataclass(frozen=True)
class AdamWSpec(OptimizerSpec):
    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01

    state_names = ("step", "exp_avg", "exp_avg_sq")

    def init_state(self, param):
        return {"step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}

    def update(self, param, grad, state):
        step = state["step"] + 1
        if self.weight_decay:
            param = param.mul(1 - self.lr * self.weight_decay)
        exp_avg = state["exp_avg"].lerp(grad, 1 - self.beta1)
        exp_avg_sq = state["exp_avg_sq"].mul(self.beta2).addcmul(grad, grad, value=1 - self.beta2)
        bias_correction1 = 1 - torch.pow(self.beta1, step)
        bias_correction2_sqrt = (1 - torch.pow(self.beta2, step)).sqrt()
        denom = exp_avg_sq.sqrt().div(bias_correction2_sqrt).add(self.eps)
        new_param = param - exp_avg.div(denom).mul(self.lr / bias_correction1)
        return new_param, {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


_UNSUPPORTED_FLAGS = ("maximize", "amsgrad", "differentiable", "capturable")


def _spec_for_group(optimizer: torch.optim.Optimizer, group: dict) -> OptimizerSpec:
    name = type(optimizer).__name__
    bad = [f for f in _UNSUPPORTED_FLAGS if group.get(f)]
    if bad:
        raise UnsupportedInputError(f"{name} option(s) {', '.join(bad)}=True are not supported")
    if isinstance(optimizer, torch.optim.SGD):
        if group.get("dampening", 0):
            raise UnsupportedInputError("SGD with dampening != 0 is not supported "
                                        "(its first step differs from the traced update)")
        return SGDSpec(lr=float(group["lr"]), momentum=float(group["momentum"]),
                       weight_decay=float(group["weight_decay"]), nesterov=bool(group["nesterov"]))
    if isinstance(optimizer, torch.optim.AdamW) or (
            isinstance(optimizer, torch.optim.Adam) and group.get("decoupled_weight_decay")):
        b1, b2 = group["betas"]
        return AdamWSpec(lr=float(group["lr"]), beta1=float(b1), beta2=float(b2),
                         eps=float(group["eps"]), weight_decay=float(group["weight_decay"]))
    raise UnsupportedInputError(f"optimizer {name} is not supported; use torch.optim.SGD or "
                                "torch.optim.AdamW")


def optimizer_spec(optimizer: torch.optim.Optimizer,
                   named_params: Mapping[str, torch.Tensor]) -> dict[str, OptimizerSpec]:
    """Map each parameter name to the spec of the param group that holds it."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedInputError(f"optimizer must be a torch.optim.Optimizer, got "
                                    f"{type(optimizer).__name__}")
    by_id = {id(p): n for n, p in named_params.items()}
    specs: dict[str, OptimizerSpec] = {}
    for group in optimizer.param_groups:
        spec = _spec_for_group(optimizer, group)
        for p in group["params"]:
            if id(p) not in by_id:
                raise UnsupportedInputError("the optimizer holds a tensor that is not a "
                                            "parameter of the model")
            specs[by_id[id(p)]] = spec
    return specs


#: Param-group entries that do not take part in the update (an lr scheduler's bookkeeping).
_NOT_HYPERPARAMETERS = ("params", "initial_lr")


def hyperparameters(optimizer: torch.optim.Optimizer) -> tuple[dict, ...]:
    """Every param group's hyper-parameters (lr, momentum, betas, weight decay, ...) as
    plain values, to notice a change after compile (an lr scheduler's step)."""
    def plain(value):
        if isinstance(value, torch.Tensor):
            return float(value) if value.numel() == 1 else tuple(value.flatten().tolist())
        return tuple(map(plain, value)) if isinstance(value, (tuple, list)) else value
    return tuple({k: plain(v) for k, v in group.items() if k not in _NOT_HYPERPARAMETERS}
                 for group in optimizer.param_groups)
