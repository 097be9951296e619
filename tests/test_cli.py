"""The command line, called as users call it: ``python -m ddlc ...`` in a subprocess.

Every command of this module starts at once (a thread pool, module fixture) so that their
imports of torch overlap; each test then waits for its own. Tiny models
(``examples/factories.py``) keep each process to a few seconds of CPU.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import FAST_GLOO_DICT
from ddlc.calibrate import fit_errors, format_fit
from ddlc.cli import parse_bytes
from ddlc.errors import FactoryError, OptionError
from ddlc.factory import load_factory
from ddlc.plan import Plan
from ddlc.report import Repeats
from ddlc.zoo import MLP

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = "examples/factories.py"
TIMEOUT = 150

RAISING = '''
def broken():
    raise ValueError("no weights for this model")


def leaves():
    raise SystemExit(3)


def misfit():
    import torch
    import torch.nn.functional as F
    from ddlc.zoo import MLP
    return MLP(8, 16, 4), (torch.randn(8, 9), torch.randint(0, 4, (8,))), F.cross_entropy
'''


def _commands(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (arguments of ``python -m ddlc``, PYTHONHASHSEED)."""
    (tmp / "raising.py").write_text(RAISING)
    (tmp / "raising.json").write_text(RAISING)  # a profile that is not JSON
    # a link the MLP's dp pays on, and compute slow enough that distributing these tiny
    # models is modeled faster than running them whole on every rank
    (tmp / "fast.json").write_text(json.dumps(FAST_GLOO_DICT | {
        "flops": {"float32": 5e9, "bfloat16": 2.5e9, "float16": 2.5e9}, "memory_bandwidth": 2.5e9}))
    full = ["plan", f"{FACTORIES}:mlp_deep", "--mesh", "2x2", "--profile", str(tmp / "fast.json"), "--graph",
            "--json", str(tmp / "plan.json"), "--svg", str(tmp / "plan.svg"), "--html", str(tmp / "plan.html")]
    return {
        "plan": (full, "1"),
        "plan_other_seed": ([*full[:-6], "--json", str(tmp / "plan2.json")], "12345"),
        "search": (["plan", f"{FACTORIES}:mlp", "--mesh", "4", "--json", str(tmp / "search.json")], "0"),
        "schedule": (["schedule", f"{FACTORIES}:mlp", "--mesh", "2", "--trace", str(tmp / "trace.json"),
                      "--profile", str(tmp / "fast.json")], "0"),
        "missing_file": (["plan", "no/such/file.py:gpt", "--mesh", "2x2"], "0"),
        "factory_raises": (["plan", f"{tmp / 'raising.py'}:broken", "--mesh", "2"], "0"),
        "factory_raises_verbose": (["plan", f"{tmp / 'raising.py'}:broken", "--mesh", "2", "-v"], "0"),
        "factory_exits": (["plan", f"{tmp / 'raising.py'}:leaves", "--mesh", "2"], "0"),
        "inputs_misfit": (["plan", f"{tmp / 'raising.py'}:misfit", "--mesh", "2"], "0"),
        "bad_mesh": (["plan", f"{FACTORIES}:mlp", "--mesh", "2y4"], "0"),
        "over_budget": (["plan", f"{FACTORIES}:mlp", "--mesh", "2", "--memory", "1KB"], "0"),
        "profile_not_json": (["plan", f"{FACTORIES}:mlp", "--mesh", "2", "--profile", str(tmp / "raising.py")
                              .replace(".py", ".json")], "0"),
        "svg_no_folder": (["plan", f"{FACTORIES}:mlp", "--mesh", "2", "--svg", str(tmp / "no" / "p.svg")], "0"),
        "micro_batches": (["plan", f"{FACTORIES}:mlp", "--mesh", "2", "--micro-batches", "2", "--graph"], "0"),
        "uneven_micro_batches": (["plan", f"{FACTORIES}:mlp", "--mesh", "2", "--micro-batches", "3"], "0"),
    }


def _run(args: list[str], seed: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    return subprocess.run([sys.executable, "-m", "ddlc", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    pool = ThreadPoolExecutor(max_workers=3)
    futures = {name: pool.submit(_run, *command) for name, command in _commands(tmp).items()}
    yield tmp, futures
    pool.shutdown(cancel_futures=True)


def _result(runs, name: str) -> subprocess.CompletedProcess:
    return runs[1][name].result(timeout=TIMEOUT)


@pytest.mark.timeout(TIMEOUT)
def test_plan_prints_the_report(runs):
    out = _result(runs, "plan")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("plan on mesh 2x2(dp,tp), profile fast-gloo, solver cd")
    assert "layers.[1-2]" in text  # the layers planned alike share one row
    for part in ("module", "parameters", "activation", "modeled step", "communication exposed",
                 "communication hidden", "peak memory per device", "collectives per step",
                 "rank 0's program by module", "[forward] layers.0"):
        assert part in text, part
    assert "ddlc.pipeline" not in text  # logs never reach stdout


@pytest.mark.timeout(TIMEOUT)
def test_plan_json_loads_as_a_plan(runs):
    assert _result(runs, "plan").returncode == 0
    path = runs[0] / "plan.json"
    plan = Plan.load(str(path))
    assert plan.mesh_shape == (2, 2) and plan.nodes
    data = json.loads(path.read_text())
    assert data["modeled_step"]["step"] > 0
    assert any(row["module"] == "layers.[1-2]" and row["layers"] == 2 for row in data["modules"])
    assert data["collectives"] and all(c["count"] >= 1 for c in data["collectives"])


def test_a_dollar_sign_in_a_name_is_drawn_as_it_is():
    # matplotlib reads text between $ signs as TeX: a path or module name with them failed
    import io
    import networkx as nx
    from ddlc.picture import draw
    svg = io.StringIO()
    draw(nx.DiGraph(), r"w$\frac$/f.py:mlp").savefig(svg, format="svg")
    assert ET.fromstring(svg.getvalue()) is not None


@pytest.mark.timeout(TIMEOUT)
def test_plan_svg_and_html_render(runs):
    assert _result(runs, "plan").returncode == 0
    svg = ET.parse(runs[0] / "plan.svg").getroot()
    ids = {e.get("id") for e in svg.iter() if e.get("id")}
    assert {"column:forward", "column:backward", "column:optimizer"} <= ids
    assert {"module:forward:layers.3", "module:forward:layers.[1-2]", "module:optimizer:layers.[1-2]"} <= ids
    texts = " ".join("".join(e.itertext()) for e in svg.iter() if e.tag.endswith("text"))
    assert "layers.[1-2]  ×2" in texts and "placement (" in texts
    collectives = [e for e in svg.iter() if (e.get("id") or "").startswith("collective:")]
    assert collectives
    assert any(kind in "".join(e.itertext()) for e in collectives for kind in ("all_gather", "reduce_scatter",
                                                                              "all_reduce", "all_to_all"))
    page = (runs[0] / "plan.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "modeled step" in page


@pytest.mark.timeout(TIMEOUT)
def test_plan_is_identical_under_other_hash_seeds(runs):
    first, second = _result(runs, "plan"), _result(runs, "plan_other_seed")
    assert first.returncode == second.returncode == 0, second.stderr
    assert first.stdout == second.stdout
    assert (runs[0] / "plan.json").read_text() == (runs[0] / "plan2.json").read_text()


@pytest.mark.timeout(TIMEOUT)
def test_mesh_search_lists_the_shapes(runs):
    out = _result(runs, "search")
    assert out.returncode == 0, out.stderr
    head = out.stdout.split("\n\n")[0]
    assert head.startswith("mesh shapes of 4 devices, best 2 of 2, by the modeled step")
    assert " 4 " in head and "2x2" in head
    rows = [line.split() for line in head.splitlines()[2:]]  # mesh, modeled step, ms, kept plan, objective, ms
    steps = [float(r[1]) for r in rows]
    assert steps == sorted(steps)  # both shapes lowered, the least modeled step first
    chosen = out.stdout.split("plan on mesh ")[1].split("(")[0]
    assert chosen == rows[0][0]
    # the plan choose_plan kept on each shape: the chosen shape's is the one the report says
    kept = [" ".join(r[3:-2]) for r in rows]
    assert set(kept) <= {"searched", "data parallel", "replicated", "start-ups priced"}
    said = re.search(r"kept (the searched plan|data parallelism|replication|the plan searched with every start-up "
                     r"priced)", out.stdout)
    assert said is not None and {"the searched plan": "searched", "data parallelism": "data parallel",
                                 "replication": "replicated"}.get(said.group(1), "start-ups priced") == kept[0]
    modeled = float(re.search(r"modeled step ([\d.]+) ms", out.stdout).group(1))
    assert modeled == pytest.approx(steps[0], abs=1e-3)  # the report is of the chosen program
    # --json holds the table too, in its order
    table = json.loads((runs[0] / "search.json").read_text())["mesh_search"]
    assert [r["mesh"] for r in table] == [r[0] for r in rows]
    assert [r["modeled_step"] * 1e3 for r in table] == pytest.approx(steps, abs=1e-3)


def test_the_search_table_breaks_ties_as_the_choice_does():
    # two shapes of the same modeled step (a replicated plan): the choice takes the one of
    # least planner objective, and the table listed the other first
    from ddlc.cli import _format_search
    results = [((4,), 3.2e-6, 3.0e-6, "", "replicated"), ((2, 2), 2.9e-6, 3.0e-6, "", "replicated"),
               ((1, 4), None, None, "cannot cut", None)]
    rows = _format_search(results).splitlines()[2:]
    assert [r.split()[0] for r in rows] == ["2x2", "4", "1x4"]


@pytest.mark.timeout(TIMEOUT)
def test_schedule_prints_the_timeline_and_writes_a_trace(runs):
    out = _result(runs, "schedule")
    assert out.returncode == 0, out.stderr
    assert "modeled step" in out.stdout and "stall ms" in out.stdout
    trace = json.loads((runs[0] / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert "compute" in names and any(n.startswith("axis0") for n in names)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("name, cause", [
    ("missing_file", "no such file 'no/such/file.py'"),
    ("factory_raises", "the factory raised ValueError: no weights for this model"),
    ("bad_mesh", "cannot parse mesh shape '2y4'"),
    ("over_budget", "no sharding fits the memory budget of 1000 B per device"),
    ("profile_not_json", "raising.json' is not valid JSON"),
    ("svg_no_folder", "cannot write --svg"),
    ("uneven_micro_batches", "batch entry 'input0' has shape (8, 32), whose first dim cannot be cut into "
                             "micro_batches=3 equal micro-batches"),
    ("factory_exits", "the factory raised SystemExit: 3"),  # rc 3 and no message before
    # torch's fake tensor mode logged the failing kernel's traceback first (19 lines)
    ("inputs_misfit", "the example inputs may not match the model (or, where eager runs the model on them, its "
                      "code fails on the path libraries take while compiling: torch.compiler.is_compiling() is "
                      "True while ddlc traces, as under torch.compile and torch.export); the example inputs are "
                      "float32[8, 9]"),
])
def test_bad_input_is_one_line_and_exit_2(runs, name, cause):
    out = _result(runs, name)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddlc plan: error: ") and cause in lines[0], out.stderr


@pytest.mark.timeout(TIMEOUT)
def test_a_plan_with_micro_batches_shows_each_micro_batchs_inputs(runs):
    out = _result(runs, "micro_batches")
    assert out.returncode == 0, out.stderr
    assert "modeled step" in out.stdout
    for name in ("input0_0_", "input0_1_", "input1_0_", "input1_1_"):  # rank 0's graph, with --graph
        assert name in out.stdout, name


@pytest.mark.timeout(TIMEOUT)
def test_verbose_bad_input_shows_the_traceback(runs):
    out = _result(runs, "factory_raises_verbose")
    assert out.returncode == 2
    assert "Traceback" in out.stderr and "ValueError: no weights for this model" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("ddlc plan: error: ")


@pytest.mark.parametrize("text, value", [("16GB", 16e9), ("512MiB", 512 * 2**20), ("1e9", 1e9), ("2 kb", 2e3)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["lots", "16 parsecs", "-1GB", "0", "1e400"])
def test_parse_bytes_refuses(text):
    with pytest.raises(OptionError, match="--memory"):
        parse_bytes(text)


def test_repeats_collapse_consecutive_identical_layers_only():
    prints = {("blocks", 0): "a", ("blocks", 1): "b", ("blocks", 2): "b", ("blocks", 3): "b",
              ("blocks", 4): "a", ("heads", 0): "b"}
    repeats = Repeats(prints)
    assert repeats.label("blocks.2.attn.qkv") == ("blocks.[1-3].attn.qkv", 3)
    assert repeats.label("blocks.0") == ("blocks.0", 1)
    assert repeats.label("blocks.4.fc") == ("blocks.4.fc", 1)
    assert repeats.label("heads.0") == ("heads.0", 1)
    assert repeats.label("") == ("(root)", 1)
    assert repeats.label("ln_f") == ("ln_f", 1)


def test_calibration_fit_errors_are_relative_to_the_measurement():
    sizes, alpha, bandwidth, p = [2**12, 2**20, 2**24], 20e-6, 2e9, 4
    times = [2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bandwidth for n in sizes]
    times[1] *= 1.1  # measured 10% slower than the model says
    rows = fit_errors(sizes, times, p, alpha, bandwidth)
    assert [r["bytes"] for r in rows] == sizes
    assert rows[0]["error"] == pytest.approx(0, abs=1e-12)
    assert rows[1]["error"] == pytest.approx(1 / 1.1 - 1)
    text = format_fit({"links": {"intra_node": {"latency": alpha, "bandwidth": bandwidth}},
                       "fit": {"all_reduce": rows}})
    assert text.splitlines()[0] == "all_reduce ring fit: latency 20.0 us, bandwidth 2 GB/s"
    assert "-9.1%" in text.splitlines()[3]


def test_factories_load_by_module_path_too():
    assert load_factory("ddlc.zoo:MLP") is MLP
    assert len(load_factory("examples.factories:mlp")()) == 3


@pytest.mark.parametrize("spec, cause", [
    ("no.such.module:f", "no module 'no.such.module'"),
    ("ddlc.zoo:nothing_here", "ddlc.zoo has no function 'nothing_here'"),
    ("ddlc.zoo", "name a factory as path/to/file.py:function"),
])
def test_factory_names_that_do_not_load(spec, cause):
    with pytest.raises(FactoryError, match=re.escape(cause)):
        load_factory(spec)


def test_the_forked_data_parallel_candidate_gives_the_plan_of_one_process():
    """``ddlc plan`` makes the data-parallel candidate in a forked process while it
    searches; the kept plan, its statistics and rank 0's program are those ``choose_plan``
    gives in one process (on this GPT, on ``cpu-gloo`` with the compute and links it measured
    on 2026-12-02, half today's FLOP/s and link bandwidth, both plans are data parallel)."""
    import copy
    import dataclasses

    import torch

    from ddlc import pipeline
    from ddlc.cli import _plan_and_lower
    from ddlc.ir import SHARDING, collective_sequence
    from ddlc.mesh import LinkModel, Mesh, load_profile
    from ddlc.options import CompileOptions
    from ddlc.zoo import GPT, lm_loss
    slower = dataclasses.replace(load_profile("cpu-gloo"), flops=(("float32", 7.5e10),), memory_bandwidth=8.9e9)
    torch.manual_seed(0)
    model = GPT(vocab=512, d_model=192, n_heads=4, n_layers=3, seq_len=64)
    g = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, 512, (16, 64), generator=g) for _ in range(2))
    options = CompileOptions()
    gm = pipeline.trace_step(model, batch, lm_loss, torch.optim.AdamW(model.parameters()), options)
    mesh = Mesh((4,), profile=slower, links=[LinkModel(8.7e-4, 6.2e8)])
    forked, alone = copy.deepcopy(gm), copy.deepcopy(gm)
    plan, program, timeline = _plan_and_lower(forked, mesh, options)
    chosen = pipeline.choose_plan(alone, mesh, options, {})
    # here the search finds data parallelism itself (the same modeled step): the search's plan is kept
    assert plan.stats.get("chosen_over_search") == chosen.plan.stats.get("chosen_over_search")
    assert (plan.stats["searched_step"], plan.stats["data_parallel_step"]) == \
        (chosen.plan.stats["searched_step"], chosen.plan.stats["data_parallel_step"])
    assert {n.name: SHARDING(n) for n in program.graph.nodes if SHARDING.has(n)} == \
        {n.name: SHARDING(n) for n in chosen.program.graph.nodes if SHARDING.has(n)}
    assert [n.name for n in program.graph.nodes] == [n.name for n in chosen.program.graph.nodes]
    assert collective_sequence(program) == collective_sequence(chosen.program)
    assert timeline.makespan == plan.stats["searched_step"]  # the kept program's, worked out once


def test_a_program_over_the_memory_budget_is_flagged():
    """The search meets the budget by its own memory model; where the lowered program's
    modeled peak exceeds it (buckets, pieces, live ranges), the report says so."""
    from ddlc.report import StepBreakdown, over_budget_note
    within = StepBreakdown(1e-3, 1e-3, 0.0, 0.0, 300e3, 400e3, 1e-3)
    over = StepBreakdown(1e-3, 1e-3, 0.0, 0.0, 536e3, 400e3, 1e-3)
    assert over_budget_note(within) == "" and "give a smaller budget" in over_budget_note(over)


SIBLING = '''
from sibling_net import make  # a module beside this file

print("loading the factories")  # at import: before the factory is called


def needs_width(width):
    return make(width)


def chatty():
    print("building the model")
    raise ValueError("stop here")


def no_parameters():
    import torch
    return torch.nn.ReLU(), (torch.randn(8, 4), torch.randn(8, 4)), torch.nn.functional.mse_loss


def one_argument_loss():
    import torch
    return make(4), (torch.randn(8, 4), torch.randn(8, 4)), lambda out: out.sum()


class Chatty(__import__("torch").nn.Linear):
    def forward(self, x):
        print("forward called")  # while traced
        __import__("os").write(1, b"written to descriptor 1\\n")
        return super().forward(x)


def chatty_forward():
    import torch
    return Chatty(4, 4), (torch.randn(8, 4), torch.randn(8, 4)), torch.nn.functional.mse_loss
'''


def test_what_the_users_code_prints_goes_to_stderr_and_the_report_or_json_to_stdout(tmp_path, monkeypatch, capfd):
    """Prints at the factory module's import and in the forward as it is traced went to
    standard output, ahead of the report (and broke ``schedule --json``'s JSON); so did a
    write to file descriptor 1 itself."""
    from ddlc.cli import main
    (tmp_path / "factories.py").write_text(SIBLING)
    (tmp_path / "sibling_net.py").write_text("import torch\n\n\ndef make(width):\n    return torch.nn.Linear(width, width)\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(["schedule", f"{tmp_path}/factories.py:chatty_forward", "--mesh", "2", "--json"]) == 0
    out = capfd.readouterr()
    json.loads(out.out)
    assert "loading the factories" in out.err and "forward called" in out.err
    assert "written to descriptor 1" in out.err


@pytest.mark.parametrize("args, cause", [
    (["plan", "{dir}/factories.py:needs_width", "--mesh", "2"],
     "ddlc calls the factory with no arguments, and it needs some (missing a required argument: 'width')"),
    (["plan", "{dir}/factories.py:chatty", "--mesh", "2"], "the factory raised ValueError: stop here"),
    (["plan", "{dir}/factories.py:no_parameters", "--mesh", "2"],
     "the model has no parameters for --optimizer adamw to train: pass --optimizer none"),
    (["plan", "{dir}/factories.py:one_argument_loss", "--mesh", "2"],
     "the step calls loss_fn(output, target)"),
    (["plan", "{dir}/factories.py:no_parameters", "--mesh", "99999999999999999999"],
     "a device count must be from 1 to"),
    (["plan", "{dir}/factories.py:no_parameters", "--mesh", "1000000x1000000"],
     "1000000000000 devices; a mesh may have at most"),
    (["calibrate", "--out", "{dir}/no/profile.json"], "cannot write --out"),
])
def test_more_bad_input_is_one_line_on_stderr_before_the_work(tmp_path, monkeypatch, capsys, args, cause):
    """Found by trying the command as a new user: a factory importing the module beside it
    failed unless run from its folder; a factory's print went into the report on stdout; a
    factory taking arguments, a model without parameters (a traceback), a loss_fn of one
    argument, a device count of 20 digits (the search hung) and ``calibrate --out`` into a
    missing folder (refused only after minutes of measuring) each get their line."""
    from ddlc.cli import main
    (tmp_path / "factories.py").write_text(SIBLING)
    (tmp_path / "sibling_net.py").write_text("import torch\n\n\ndef make(width):\n    return torch.nn.Linear(width, width)\n")
    monkeypatch.chdir(ROOT)  # not the factory's folder
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main([a.format(dir=tmp_path) for a in args]) == 2
    out = capsys.readouterr()
    assert out.out == "", out.out
    assert cause in out.err.strip().splitlines()[-1], out.err


@pytest.mark.parametrize("args, cause", [
    (["calibrate", "--world-size", "0"], "--world-size 0: collectives need 2 processes or more"),
    (["calibrate", "--world-size", "2", "--mesh", "2x2"], "--mesh 2x2 has 4 devices but --world-size is 2"),
])
def test_calibrate_refuses_a_world_it_cannot_measure_before_starting(capsys, args, cause):
    """``--world-size 0`` was refused as a mesh shape, and ``--world-size 2 --mesh 2x2``
    measured 4 processes without a word."""
    from ddlc.cli import main
    assert main(args) == 2
    assert cause in capsys.readouterr().err


def test_the_module_table_is_in_forward_order_whatever_modules_hold_buffers():
    """The trace clones every buffer as the forward starts (the copy the forward may
    update in place): a module holding one came first in the plan table, before the
    modules the forward runs earlier (DeepSeek-V3's router bias put ``layers.1.mlp.gate``
    above the embedding)."""
    import torch
    from torch import nn

    from ddlc import Mesh, pipeline
    from ddlc.ir import STEP
    from ddlc.options import CompileOptions
    from ddlc.report import module_rows

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)
            self.register_buffer("scale", torch.full((4,), 2.0))

        def forward(self, x):
            return self.lin(x) * self.scale

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Scaled())
    gm = pipeline.trace_step(model, (torch.randn(8, 4), torch.randn(8, 4)), torch.nn.functional.mse_loss,
                             torch.optim.SGD(model.parameters(), lr=0.1), CompileOptions())
    plan = pipeline.plan(gm, Mesh((2,)), CompileOptions(), {})
    order = [row.module for row in module_rows(plan, STEP(gm))]
    assert order.index("0") < order.index("2") and order.index("0") < order.index("2.lin")


@pytest.mark.timeout(TIMEOUT)
def test_operator_times_measured_by_the_command_are_cached(tmp_path):
    """``--compute measured`` times the plan's operators and caches them on disk, so the next
    command reads them; the command ends with ``os._exit``, which skips the exit handler
    that saved the cache, so nothing was saved and every command measured again."""
    env = {**os.environ, "DDLC_CACHE_DIR": str(tmp_path)}
    command = [sys.executable, "-m", "ddlc", "plan", f"{FACTORIES}:mlp", "--mesh", "2", "--compute", "measured"]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    cached = list(tmp_path.rglob("*"))
    assert any(p.is_file() and p.stat().st_size > 0 for p in cached), cached
