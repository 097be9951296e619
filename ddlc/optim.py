"""Functional optimizer updates that trace into the step graph.

Each spec mirrors one ``torch.optim`` class (single-tensor CPU path) as pure
tensor arithmetic, so the update appears in the graph as ordinary aten ops
whose inputs are the parameter, its gradient and its state tensors.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Mapping

import torch

from .errors import UnsupportedInputError

__all__ = ["OptimizerSpec", "SGDSpec", "AdamWSpec", "AdamSpec", "RMSpropSpec", "AdagradSpec", "AdadeltaSpec",
           "AdamaxSpec", "NAdamSpec", "RAdamSpec", "optimizer_spec", "hyperparameter_key", "hyperparameter_values",
           "refuse_step_hooks", "structure"]


class OptimizerSpec:
    """One param group's update: its hyper-parameters and the names of its state tensors.

    The hyper-parameters named in ``inputs`` are inputs of the traced step (0-d tensors,
    read from the optimizer's ``param_groups`` at every step, so lr schedulers and edits
    of ``param_groups`` take effect); the spec's values are the ones at compile time. The
    rest, and whether each of ``gates`` is zero, shape the graph: :meth:`structure`."""

    state_names: tuple[str, ...] = ()
    #: the state tensors shaped like the parameter (the others are scalars: Adam's step)
    per_element: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    gates: tuple[str, ...] = ()
    #: fields that only set the state's start (:meth:`initial_value`): torch.optim reads
    #: them once, when it makes the state, so a later edit changes nothing
    initial_only: tuple[str, ...] = ()
    #: ascend instead of descend (each spec's dataclass field; torch.optim's ``maximize``)
    maximize: bool = False

    @classmethod
    def group_values(cls, group: dict) -> dict[str, object]:
        """The values of the ``inputs`` hyper-parameters in param group ``group`` (its
        ``betas`` pair gives ``beta1`` and ``beta2``)."""
        entries = {**group, **dict(zip(("beta1", "beta2"), group.get("betas", ())))}
        return {name: entries[name] for name in cls.inputs}

    @classmethod
    def from_group(cls, group: dict) -> "OptimizerSpec":
        """The spec of param group ``group``: each field the group's entry of that name
        (``beta1`` and ``beta2`` from ``betas``), as the field's type; a field the group
        lacks keeps its default (``maximize`` of an optimizer pickled before torch had it)."""
        values = {k: float(v) for k, v in cls.group_values(group).items()}
        for f in dataclasses.fields(cls):
            if f.name not in values and f.name in group:
                values[f.name] = type(f.default)(group[f.name])
        return cls(**values)

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state of a parameter that has not stepped: each :attr:`per_element` state
        like ``param``, each other one (a step count, NAdam's product of momenta) a 0-d
        tensor of torch.optim's dtype for them (float32; float64 where that is the default
        dtype), every one filled with its :meth:`initial_value` (so each rank of a compiled
        step makes its own pieces, without the whole)."""
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        return {name: torch.full_like(param, self.initial_value(name)) if name in self.per_element
                else torch.tensor(self.initial_value(name), dtype=scalar) for name in self.state_names}

    def initial_value(self, state_name: str) -> float:
        """The value every element of state ``state_name`` starts at."""
        return 0.0

    def derived(self, hp: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The scalars the update reads, from the hyper-parameter inputs ``hp`` (0-d tensors
        keyed by ``inputs``): computed once per param group, not once per parameter."""
        return dict(hp)

    def update(self, param, grad, state: Mapping[str, torch.Tensor], hp: Mapping[str, torch.Tensor]):
        """Return ``(new_param, new_state)`` with the scalars ``hp`` of :meth:`derived`;
        never mutates its inputs."""
        raise NotImplementedError

    def apply(self, param, grad, state: Mapping[str, torch.Tensor], hp: Mapping[str, torch.Tensor]):
        """:meth:`update`, keeping the parameter's and its state's dtypes as torch.optim
        does. The scalars ``hp`` are 0-d float64 tensors where torch.optim has Python
        floats, and a 0-d tensor does not promote a tensor with dimensions but does promote
        another 0-d one: a 0-d float32 parameter (a learnable temperature) would come out
        float64. So a 0-d parameter, its gradient and its :attr:`per_element` state are
        updated as one-element vectors and given back their shape. A complex parameter is
        updated as its real and imaginary parts (``view_as_real``), as torch.optim does (Adam's
        second moment is then per part, not ``|g|^2``). With ``maximize`` the update takes
        the negated gradient, as torch.optim does before anything else."""
        return self._apply(param, grad.neg() if self.maximize else grad, state, hp)

    def _apply(self, param, grad, state, hp):
        if param.is_complex():
            parts = {k: torch.view_as_real(v) if k in self.per_element else v for k, v in state.items()}
            new_param, new_state = self._apply(torch.view_as_real(param), torch.view_as_real(grad), parts, hp)
            return torch.view_as_complex(new_param), {
                k: torch.view_as_complex(v) if k in self.per_element else v for k, v in new_state.items()}
        if param.dim() != 0:
            return self.update(param, grad, state, hp)
        vector = {k: v.reshape(1) if k in self.per_element else v for k, v in state.items()}
        new_param, new_state = self.update(param.reshape(1), grad.reshape(1), vector, hp)
        return new_param.reshape(()), {k: v.reshape(()) if k in self.per_element else v
                                       for k, v in new_state.items()}

    def values(self) -> dict[str, float]:
        """The compile-time values of the ``inputs`` hyper-parameters."""
        return {name: getattr(self, name) for name in self.inputs}

    def structure(self) -> tuple:
        """What the traced graph depends on: the update (this spec's kind), every other
        field, and which gates are zero."""
        fields = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                  if f.name not in self.inputs and f.name not in self.initial_only]
        return (("update", type(self).__name__), *fields,
                *((name, getattr(self, name) != 0) for name in self.gates))


@dataclass(frozen=True)
class SGDSpec(OptimizerSpec):
    """``torch.optim.SGD``: momentum (nesterov), L2 weight decay. torch starts the momentum
    buffer as a copy of the first gradient; a zero buffer gives the same first step while
    dampening is 0 (``momentum * 0 + g``), so dampening is refused."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False

    inputs = ("lr", "momentum", "weight_decay")
    gates = ("momentum", "weight_decay")

    per_element = ("momentum_buffer",)

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()

    def derived(self, hp):
        return {**hp, "neg_lr": -hp["lr"]}

    def update(self, param, grad, state, hp):
        # addcmul(a, b, s) = a + b * s: one kernel, as torch.optim's add(..., alpha=s)
        if self.weight_decay:
            grad = torch.addcmul(grad, param, hp["weight_decay"])
        new_state = {}
        if self.momentum:
            buf = torch.addcmul(grad, state["momentum_buffer"], hp["momentum"])
            new_state["momentum_buffer"] = buf
            grad = torch.addcmul(grad, buf, hp["momentum"]) if self.nesterov else buf
        return torch.addcmul(param, grad, hp["neg_lr"]), new_state


@dataclass(frozen=True)
class AdamWSpec(OptimizerSpec):
    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    amsgrad: bool = False
    maximize: bool = False

    per_element = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    inputs = ("lr", "beta1", "beta2", "eps", "weight_decay")
    gates = ("weight_decay",)

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("step", "exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if self.amsgrad else ()))

    def derived(self, hp):
        out = {**hp, "one_minus_beta1": 1 - hp["beta1"], "one_minus_beta2": 1 - hp["beta2"]}
        if self.weight_decay:
            out["decay"] = 1 - hp["lr"] * hp["weight_decay"]
        return out

    def update(self, param, grad, state, hp):
        if self.weight_decay:
            param = param * hp["decay"]
        return self._moments_step(param, grad, state, hp)

    def _moments_step(self, param, grad, state, hp):
        """Adam's moment update and bias-corrected step (after any weight decay); with
        ``amsgrad``, the step divides by the largest second moment so far instead."""
        step = state["step"] + 1
        exp_avg = state["exp_avg"].lerp(grad, hp["one_minus_beta1"])
        # beta2 * v + (1 - beta2) * g^2, as a lerp (one kernel after g^2)
        exp_avg_sq = state["exp_avg_sq"].lerp(grad * grad, hp["one_minus_beta2"])
        new_state = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        second = exp_avg_sq
        if self.amsgrad:
            second = new_state["max_exp_avg_sq"] = torch.maximum(state["max_exp_avg_sq"], exp_avg_sq)
        bias_correction1 = 1 - torch.pow(hp["beta1"], step)
        bias_correction2_sqrt = (1 - torch.pow(hp["beta2"], step)).sqrt()
        denom = second.sqrt().div(bias_correction2_sqrt).add(hp["eps"])
        return param - exp_avg.div(denom).mul(hp["lr"] / bias_correction1), new_state


@dataclass(frozen=True)
class AdamSpec(AdamWSpec):
    """``torch.optim.Adam``: AdamW's moments, with L2 weight decay added to the gradient
    (``grad + weight_decay * param``) instead of decoupled from it."""

    weight_decay: float = 0.0

    def derived(self, hp):
        return {**hp, "one_minus_beta1": 1 - hp["beta1"], "one_minus_beta2": 1 - hp["beta2"]}

    def update(self, param, grad, state, hp):
        if self.weight_decay:
            grad = torch.addcmul(grad, param, hp["weight_decay"])
        return self._moments_step(param, grad, state, hp)


@dataclass(frozen=True)
class RMSpropSpec(OptimizerSpec):
    """``torch.optim.RMSprop``: the average of squared gradients (centered: minus the
    squared average gradient), optional momentum on the scaled gradient, L2 weight decay."""

    lr: float
    alpha: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False
    maximize: bool = False

    per_element = ("square_avg", "momentum_buffer", "grad_avg")
    inputs = ("lr", "alpha", "eps", "weight_decay", "momentum")
    gates = ("weight_decay", "momentum")

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("step", "square_avg", *(("momentum_buffer",) if self.momentum else ()),
                *(("grad_avg",) if self.centered else ()))

    def derived(self, hp):
        return {**hp, "one_minus_alpha": 1 - hp["alpha"], "neg_lr": -hp["lr"]}

    def update(self, param, grad, state, hp):
        # each product in torch.optim's order: addcmul_(a, b, value=s) computes (s * a) * b,
        # addcdiv_(a, b, value=s) computes (s * a) / b
        if self.weight_decay:
            grad = torch.addcmul(grad, param, hp["weight_decay"])
        square_avg = torch.addcmul(state["square_avg"] * hp["alpha"], grad * hp["one_minus_alpha"], grad)
        new_state = {"step": state["step"] + 1, "square_avg": square_avg}
        if self.centered:
            grad_avg = new_state["grad_avg"] = state["grad_avg"].lerp(grad, hp["one_minus_alpha"])
            avg = torch.addcmul(square_avg, grad_avg, grad_avg, value=-1).sqrt()
        else:
            avg = square_avg.sqrt()
        avg = avg + hp["eps"]
        if self.momentum:
            buf = new_state["momentum_buffer"] = torch.addcdiv(state["momentum_buffer"] * hp["momentum"], grad, avg)
            return torch.addcmul(param, buf, hp["neg_lr"]), new_state
        return torch.addcdiv(param, grad * hp["neg_lr"], avg), new_state


@dataclass(frozen=True)
class AdagradSpec(OptimizerSpec):
    """``torch.optim.Adagrad`` (dense gradients): the sum of squared gradients, a step
    size decayed as ``lr / (1 + (step - 1) * lr_decay)``, L2 weight decay. The sum starts
    at ``initial_accumulator_value`` (torch.optim makes the state when the optimizer is
    made; compile takes it from there)."""

    lr: float
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    maximize: bool = False

    state_names = ("step", "sum")
    per_element = ("sum",)
    inputs = ("lr", "lr_decay", "weight_decay", "eps")
    gates = ("weight_decay",)
    initial_only = ("initial_accumulator_value",)

    def initial_value(self, state_name: str) -> float:
        return self.initial_accumulator_value if state_name == "sum" else 0.0

    def update(self, param, grad, state, hp):
        step = state["step"] + 1
        if self.weight_decay:
            grad = torch.addcmul(grad, param, hp["weight_decay"])
        # 0-d tensors: computed in float64, as torch.optim computes it in Python floats
        neg_clr = -hp["lr"] / (1 + (step - 1) * hp["lr_decay"])
        total = torch.addcmul(state["sum"], grad, grad)
        return torch.addcdiv(param, grad * neg_clr, total.sqrt() + hp["eps"]), {"step": step, "sum": total}


@dataclass(frozen=True)
class AdadeltaSpec(OptimizerSpec):
    """``torch.optim.Adadelta``: running averages of squared gradients and of squared
    updates (both with ``rho``), the update the gradient scaled by the ratio of their
    roots, times ``lr``; L2 weight decay."""

    lr: float = 1.0
    rho: float = 0.9
    eps: float = 1e-6
    weight_decay: float = 0.0
    maximize: bool = False

    state_names = ("step", "square_avg", "acc_delta")
    per_element = ("square_avg", "acc_delta")
    inputs = ("lr", "rho", "eps", "weight_decay")
    gates = ("weight_decay",)

    def derived(self, hp):
        return {**hp, "one_minus_rho": 1 - hp["rho"], "neg_lr": -hp["lr"]}

    def update(self, param, grad, state, hp):
        if self.weight_decay:
            grad = torch.addcmul(grad, param, hp["weight_decay"])
        square_avg = torch.addcmul(state["square_avg"] * hp["rho"], grad * hp["one_minus_rho"], grad)
        delta = (state["acc_delta"] + hp["eps"]).sqrt() / (square_avg + hp["eps"]).sqrt() * grad
        acc_delta = torch.addcmul(state["acc_delta"] * hp["rho"], delta * hp["one_minus_rho"], delta)
        return torch.addcmul(param, delta, hp["neg_lr"]), {
            "step": state["step"] + 1, "square_avg": square_avg, "acc_delta": acc_delta}


@dataclass(frozen=True)
class AdamaxSpec(OptimizerSpec):
    """``torch.optim.Adamax``: Adam's first moment, and instead of its second an
    exponentially weighted infinity norm ``max(beta2 * u, |g| + eps)``; L2 weight decay."""

    lr: float = 2e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    maximize: bool = False

    state_names = ("step", "exp_avg", "exp_inf")
    per_element = ("exp_avg", "exp_inf")
    inputs = ("lr", "beta1", "beta2", "eps", "weight_decay")
    gates = ("weight_decay",)

    def derived(self, hp):
        return {**hp, "one_minus_beta1": 1 - hp["beta1"]}

    def update(self, param, grad, state, hp):
        step = state["step"] + 1
        if self.weight_decay:
            grad = torch.addcmul(grad, param, hp["weight_decay"])
        exp_avg = state["exp_avg"].lerp(grad, hp["one_minus_beta1"])
        exp_inf = torch.maximum(state["exp_inf"] * hp["beta2"], grad.abs() + hp["eps"])
        neg_clr = -hp["lr"] / (1 - torch.pow(hp["beta1"], step))
        return torch.addcdiv(param, exp_avg * neg_clr, exp_inf), {"step": step, "exp_avg": exp_avg,
                                                                  "exp_inf": exp_inf}


def _weight_decayed(spec, param, grad, hp):
    """``(param, grad)`` after ``spec``'s weight decay: none where it is 0, else decoupled
    (the parameter shrunk by ``lr * weight_decay``) where ``spec.decoupled_weight_decay``,
    else L2 (``weight_decay * param`` added to the gradient)."""
    if not spec.weight_decay:
        return param, grad
    if spec.decoupled_weight_decay:
        return param * (1 - hp["lr"] * hp["weight_decay"]), grad
    return param, torch.addcmul(grad, param, hp["weight_decay"])


@dataclass(frozen=True)
class NAdamSpec(OptimizerSpec):
    """``torch.optim.NAdam``: Adam's moments with Nesterov momentum. The momentum of step
    ``t`` is ``mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))``, and their running
    product ``mu_product`` is state (a float32 scalar, multiplied by ``mu_t`` rounded to
    float32, as torch.optim's in-place product of a float32 tensor and a Python float);
    L2 or (``decoupled_weight_decay``) decoupled weight decay."""

    lr: float = 2e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum_decay: float = 4e-3
    decoupled_weight_decay: bool = False
    maximize: bool = False

    state_names = ("step", "mu_product", "exp_avg", "exp_avg_sq")
    per_element = ("exp_avg", "exp_avg_sq")
    inputs = ("lr", "beta1", "beta2", "eps", "weight_decay", "momentum_decay")
    gates = ("weight_decay",)

    def initial_value(self, state_name: str) -> float:
        return 1.0 if state_name == "mu_product" else 0.0

    def derived(self, hp):
        return {**hp, "one_minus_beta1": 1 - hp["beta1"], "one_minus_beta2": 1 - hp["beta2"]}

    def update(self, param, grad, state, hp):
        step = state["step"] + 1
        param, grad = _weight_decayed(self, param, grad, hp)
        mu = hp["beta1"] * (1.0 - 0.5 * torch.pow(0.96, step * hp["momentum_decay"]))
        mu_next = hp["beta1"] * (1.0 - 0.5 * torch.pow(0.96, (step + 1) * hp["momentum_decay"]))
        mu_product = state["mu_product"] * mu.to(state["mu_product"].dtype)
        exp_avg = state["exp_avg"].lerp(grad, hp["one_minus_beta1"])
        exp_avg_sq = state["exp_avg_sq"].lerp(grad * grad, hp["one_minus_beta2"])
        denom = exp_avg_sq.div(1 - torch.pow(hp["beta2"], step)).sqrt().add(hp["eps"])
        param = torch.addcdiv(param, grad * (-hp["lr"] * (1.0 - mu) / (1.0 - mu_product)), denom)
        param = torch.addcdiv(param, exp_avg * (-hp["lr"] * mu_next / (1.0 - mu_product * mu_next)), denom)
        return param, {"step": step, "mu_product": mu_product, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


@dataclass(frozen=True)
class RAdamSpec(OptimizerSpec):
    """``torch.optim.RAdam``: Adam's moments, the adaptive step rectified by the variance
    of its estimate where the length of the approximated simple moving average ``rho_t``
    exceeds 5, plain momentum SGD before (the branch a ``where`` on the step count, both
    computed); L2 or (``decoupled_weight_decay``) decoupled weight decay."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False
    maximize: bool = False

    state_names = ("step", "exp_avg", "exp_avg_sq")
    per_element = ("exp_avg", "exp_avg_sq")
    inputs = ("lr", "beta1", "beta2", "eps", "weight_decay")
    gates = ("weight_decay",)

    def derived(self, hp):
        return {**hp, "one_minus_beta1": 1 - hp["beta1"], "one_minus_beta2": 1 - hp["beta2"],
                "rho_inf": 2 / (1 - hp["beta2"]) - 1}

    def update(self, param, grad, state, hp):
        step = state["step"] + 1
        param, grad = _weight_decayed(self, param, grad, hp)
        exp_avg = state["exp_avg"].lerp(grad, hp["one_minus_beta1"])
        exp_avg_sq = state["exp_avg_sq"].lerp(grad * grad, hp["one_minus_beta2"])
        bias_correction2 = 1 - torch.pow(hp["beta2"], step)
        momentum = exp_avg / (1 - torch.pow(hp["beta1"], step)) * hp["lr"]
        rho_inf = hp["rho_inf"]
        rho_t = rho_inf - 2 * step * torch.pow(hp["beta2"], step) / bias_correction2
        # NaN before rho_t reaches 4; the where then takes the other branch
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)).sqrt()
        adaptive = bias_correction2.sqrt() / (exp_avg_sq.sqrt() + hp["eps"])
        step_taken = torch.where(rho_t > 5.0, momentum * adaptive * rect, momentum)
        return param - step_taken, {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


#: torch.optim.Optimizer classes (each a subclass's base too) -> the spec of a param group's update
SPECS: dict[type, type[OptimizerSpec]] = {
    torch.optim.SGD: SGDSpec, torch.optim.Adam: AdamWSpec, torch.optim.RMSprop: RMSpropSpec,
    torch.optim.Adagrad: AdagradSpec, torch.optim.Adadelta: AdadeltaSpec, torch.optim.Adamax: AdamaxSpec,
    torch.optim.NAdam: NAdamSpec, torch.optim.RAdam: RAdamSpec}

_UNSUPPORTED_FLAGS = ("differentiable", "capturable")


def _spec_for_group(optimizer: torch.optim.Optimizer, group: dict) -> OptimizerSpec:
    name = type(optimizer).__name__
    bad = [f for f in _UNSUPPORTED_FLAGS if group.get(f)]
    if bad:
        raise UnsupportedInputError(f"{name} option(s) {', '.join(bad)}=True are not supported")
    base = next((b for b in (torch.optim.AdamW, *SPECS) if isinstance(optimizer, b)), None)
    if base is None:
        names = ", ".join(b.__name__ for b in (*SPECS, torch.optim.AdamW))
        raise UnsupportedInputError(f"optimizer {name} is not supported; use one of torch.optim's {names}")
    if inspect.unwrap(type(optimizer).step) is not inspect.unwrap(base.step):
        raise UnsupportedInputError(
            f"optimizer {name} subclasses torch.optim.{base.__name__} with a step() of its own, "
            f"which ddlc does not run: it compiles {base.__name__}'s own update (use "
            f"torch.optim.{base.__name__} itself)")
    if base is torch.optim.SGD and group.get("dampening", 0) and group.get("momentum", 0):
        # torch ignores dampening without momentum
        raise UnsupportedInputError("SGD with momentum and dampening != 0 is not supported "
                                    "(its first step differs from the traced update)")
    if isinstance(optimizer, torch.optim.Adam):  # AdamW too: its groups' flag decides, as in torch.optim
        decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        return (AdamWSpec if decoupled else AdamSpec).from_group(group)
    return SPECS[base].from_group(group)


def refuse_non_optimizer(optimizer) -> None:
    """Refuse an ``optimizer`` that is not one ``torch.optim.Optimizer``: several of them (a
    tutorial's encoder and decoder optimizers) name the way to one."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return
    if isinstance(optimizer, (list, tuple)) and optimizer and \
            all(isinstance(o, torch.optim.Optimizer) for o in optimizer):
        kinds = ", ".join(type(o).__name__ for o in optimizer)
        raise UnsupportedInputError(
            f"optimizer is a {type(optimizer).__name__} of {len(optimizer)} optimizers ({kinds}); a "
            "compiled step runs one: give one optimizer with a param group per part of the model, "
            "each with its own hyper-parameters (torch.optim.SGD([{'params': encoder.parameters()}, "
            "{'params': decoder.parameters(), 'lr': 0.01}], lr=0.1)); an lr scheduler of it sets "
            "every group's lr")
    raise UnsupportedInputError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")


def refuse_step_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer with step hooks (its own ``register_step_pre_hook`` /
    ``register_step_post_hook``, or torch.optim's global ones): torch.optim runs them
    around every ``optimizer.step()``, which a compiled step never calls (the update is
    part of its program), so they would silently not run."""
    from torch.optim import optimizer as optimizer_module

    def users(hooks) -> list:  # torch's own (the profiler's, with KINETO_USE_DAEMON) aside
        return [h for h in (hooks or {}).values() if not getattr(h, "__module__", "").startswith("torch.")]

    kinds = [kind for kind, hooks in (
        ("a step pre-hook (register_step_pre_hook)", getattr(optimizer, "_optimizer_step_pre_hooks", None)),
        ("a step post-hook (register_step_post_hook)", getattr(optimizer, "_optimizer_step_post_hooks", None)),
        ("a global step pre-hook (register_optimizer_step_pre_hook)", optimizer_module._global_optimizer_pre_hooks),
        ("a global step post-hook (register_optimizer_step_post_hook)", optimizer_module._global_optimizer_post_hooks),
    ) if users(hooks)]
    if kinds:
        raise UnsupportedInputError(
            f"the optimizer has {' and '.join(kinds)}, which torch.optim runs around every "
            "optimizer.step(); a compiled step runs the update inside its program and never calls "
            "optimizer.step(), so the hook would not run: remove it (a constraint on the weights "
            "can be a parametrization of the model, traced with it)")


def optimizer_spec(optimizer: torch.optim.Optimizer,
                   named_params: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, OptimizerSpec]]:
    """Map each parameter name to (the index of its param group, that group's spec)."""
    refuse_non_optimizer(optimizer)
    refuse_step_hooks(optimizer)
    by_id = {id(p): n for n, p in named_params.items()}
    specs: dict[str, tuple[int, OptimizerSpec]] = {}
    for index, group in enumerate(optimizer.param_groups):
        spec = _spec_for_group(optimizer, group)
        for p in group["params"]:
            if id(p) not in by_id:
                raise UnsupportedInputError(
                    f"param group {index} of the optimizer holds a tensor of shape {tuple(p.shape)} "
                    "that is not a parameter of the model (a loss function's own parameter, say): "
                    "ddlc compiles the model's step and trains the model's parameters only; make it "
                    "a parameter of the model (a submodule that holds it), or leave it out of the "
                    "optimizer")
            specs[by_id[id(p)]] = (index, spec)
    return specs


def hyperparameter_key(group: int, name: str) -> str:
    """The step input key of hyper-parameter ``name`` of param group ``group``."""
    return f"group{group}.{name}"


def hyperparameter_values(optimizer: torch.optim.Optimizer, groups: Mapping[int, OptimizerSpec]) -> dict:
    """The current value of every hyper-parameter input, keyed by :func:`hyperparameter_key`,
    read from the optimizer's param groups (``groups``: index -> the compiled spec)."""
    return {hyperparameter_key(g, name): float(value) for g, spec in groups.items()
            for name, value in type(spec).group_values(optimizer.param_groups[g]).items()}


def group_hyperparameters(optimizer: torch.optim.Optimizer) -> tuple[dict[str, float], ...]:
    """Per param group, the value of every hyper-parameter a compiled step reads from it
    (:meth:`OptimizerSpec.group_values`)."""
    return tuple({name: float(value) for name, value in
                  type(_spec_for_group(optimizer, g)).group_values(g).items()}
                 for g in optimizer.param_groups)


def structure(optimizer: torch.optim.Optimizer) -> tuple:
    """Per param group, what a compiled step depends on (:meth:`OptimizerSpec.structure`)
    and its number of parameters: a change means the graph must be traced again."""
    return tuple((_spec_for_group(optimizer, g).structure(), len(g["params"]))
                 for g in optimizer.param_groups)
