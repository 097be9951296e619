"""Compile options: one frozen object, validated before any work starts."""
import math

import pytest
import torch

from ddlc.errors import OptionError
from ddlc.options import CompileOptions


def test_defaults_are_valid_and_frozen():
    options = CompileOptions()
    assert options.solver == "cd" and options.fuse is True and options.partition is True
    with pytest.raises(Exception):
        options.solver = "exact"


@pytest.mark.parametrize("kwargs, named", [
    ({"solvr": "cd"}, "solvr"),                        # unknown, with a suggestion
    ({"solver": "milp"}, "solver"),                    # outside its choices
    ({"batch": "per-rank"}, "batch"),
    ({"decouple": "sometimes"}, "decouple"),
    ({"ag_placement": "later"}, "ag_placement"),
    ({"updates": "early", "schedule": False}, "updates"),  # contradictory
    ({"max_live_bytes": 1e6, "schedule": False}, "max_live_bytes"),
    ({"memory_budget": -1}, "memory_budget"),
    ({"fuse": "yes"}, "fuse"),
    ({"partition": -5}, "partition"),
    ({"num_targets": 1.5}, "num_targets"),
    ({"schedule": 1}, "schedule"),                     # an int is not a bool
    ({"clip_grad_value": 0}, "clip_grad_value"),
    ({"clip_grad_value": math.inf}, "clip_grad_value"),
    ({"clip_grad_value": 0.5, "clip_grad_norm": 1.0}, "clip_grad_norm and clip_grad_value"),
    ({"placements": {"fc.weight": 5}}, "placement of 'fc.weight': 5 is not a placement"),
    ({"placements": {"input0": None}}, "placement of 'input0': None is not a placement"),
    ({"placements": {"input0": "(S0, X)"}}, "placement of 'input0': cannot parse SBP"),
])
def test_bad_options_name_the_option(kwargs, named):
    with pytest.raises(OptionError, match=named):
        CompileOptions.from_kwargs(**kwargs)


def test_unknown_option_suggests_the_closest_name():
    with pytest.raises(OptionError, match="did you mean 'memory_budget'"):
        CompileOptions.from_kwargs(memory_budgt=1e9)


def test_numbers_and_literals_are_accepted():
    options = CompileOptions.from_kwargs(fuse=2**20, partition=False, decouple="always",
                                         memory_budget=10**9, max_inflight_bytes=math.inf,
                                         placements=None)
    assert options.fuse == 2**20 and options.partition is False and options.placements == {}


def test_compile_validates_options_before_anything_else():
    import ddlc
    # no process group is initialised: the option error must come first
    with pytest.raises(OptionError, match="solver"):
        ddlc.compile(torch.nn.Linear(2, 2), "1", (torch.zeros(2, 2),), solver="fast")
