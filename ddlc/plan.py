"""The sharding plan: every node's chosen signature and what it costs.

A :class:`Plan` is plain data (JSON round-trips exactly) plus, when it comes
straight from the solver (:func:`passes.sharding.shard`), the problem it solved, so
``explain`` can show each candidate's costs. It prints as a table; ``diff`` compares two plans.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .printing import format_sbps

__all__ = ["NodePlan", "Plan"]


@dataclass(frozen=True)
class NodePlan:
    name: str
    op: str
    module: str
    phase: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    compute: float         # seconds at local shapes
    communication: float   # seconds of boxing into this node
    memory: float          # resident bytes per device


@dataclass
class Plan:
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    profile: str
    solver: str
    objective: float
    nodes: list[NodePlan]
    stats: dict = field(default_factory=dict)
    problem: Any = field(default=None, repr=False, compare=False)
    choice: list[int] | None = field(default=None, repr=False, compare=False)

    # -- totals ---------------------------------------------------------------
    @property
    def compute(self) -> float:
        return sum(n.compute for n in self.nodes)

    @property
    def communication(self) -> float:
        return sum(n.communication for n in self.nodes)

    @property
    def memory(self) -> float:
        return sum(n.memory for n in self.nodes)

    def without_solver(self) -> "Plan":
        """This plan without the solver's ``problem`` and ``choice`` (large; only the
        process that solved needs them): what is sent to other processes."""
        return replace(self, problem=None, choice=None)

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in the plan")

    # -- text -------------------------------------------------------------------
    def summary(self) -> str:
        mesh = "x".join(map(str, self.mesh_shape)) + f"({','.join(self.axis_names)})"
        return (f"plan on mesh {mesh}, profile {self.profile}, solver {self.solver}: planner objective "
                f"{self.objective * 1e3:.3f} ms = compute {self.compute * 1e3:.3f} ms + "
                f"communication {self.communication * 1e3:.3f} ms; resident memory "
                f"{self.memory / 2**20:.2f} MiB per device")

    def table(self, limit: int | None = None, skip_free: bool = False) -> str:
        rows = [("node", "op", "module", "signature", "compute us", "comm us", "mem KiB")]
        nodes = [n for n in self.nodes if not skip_free or n.compute or n.communication]
        for n in nodes[:limit]:
            sig = f"{', '.join(n.inputs)} -> {', '.join(n.outputs)}" if n.inputs else ", ".join(n.outputs)
            rows.append((n.name, n.op, n.module, sig, f"{n.compute * 1e6:.2f}",
                         f"{n.communication * 1e6:.2f}", f"{n.memory / 1024:.1f}"))
        if limit is not None and len(nodes) > limit:
            rows.append((f"... {len(nodes) - limit} more", "", "", "", "", "", ""))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

    def __str__(self) -> str:
        return self.summary() + "\n" + self.table()

    def explain(self, name_or_module: str) -> str:
        """Every candidate of a node (or of each node of a module) with its costs given
        the rest of the plan, and why the chosen one won."""
        if self.problem is None:
            raise ValueError("explain needs the plan as the solver returned it (a plan loaded "
                             "from JSON has no candidates)")
        p = self.problem
        names = [n.name for n in self.nodes]
        targets = [name_or_module] if name_or_module in names else [
            n.name for n in self.nodes if n.module == name_or_module
            or n.module.startswith(name_or_module + ".")]
        if not targets:
            raise KeyError(f"{name_or_module!r} is neither a node nor a module path in the plan")
        by_name = {n.name: n for n in p.nodes}
        out = []
        for name in targets:
            v = p.var_of[by_name[name]]
            local = p.local_cost(v, self.choice)
            chosen = self.choice[v]
            out.append(f"{name} ({self.node(name).op}, module {self.node(name).module or '<root>'}):")
            order = sorted(range(len(local)), key=lambda k: (local[k], k))
            for k in order:
                cand = p.candidates[v][k]
                mark = "*" if k == chosen else " "
                out.append(f"  {mark} {format_sbps(cand.inputs)} -> {format_sbps(cand.outputs)}: "
                           f"compute {p.compute[v][k] * 1e6:.2f} us, boxing and neighbours "
                           f"{(local[k] - p.compute[v][k]) * 1e6:.2f} us, total {local[k] * 1e6:.2f} us, "
                           f"memory {p.memory[v][k] / 1024:.1f} KiB")
            if local[chosen] <= local[order[0]] + 1e-15:
                out.append("  chosen: the cheapest candidate with its neighbours as planned")
            else:
                out.append("  chosen: not the cheapest alone; it wins as part of its module's "
                           "joint move or under the memory budget")
        return "\n".join(out)

    def diff(self, other: "Plan") -> str:
        """Nodes whose signature differs, then the change in the totals."""
        mine = {n.name: n for n in self.nodes}
        lines = []
        for n in other.nodes:
            m = mine.get(n.name)
            if m is None:
                lines.append(f"+ {n.name}: only in the other plan")
            elif (m.inputs, m.outputs) != (n.inputs, n.outputs):
                lines.append(f"~ {n.name}: {', '.join(m.inputs)} -> {', '.join(m.outputs)}  |  "
                             f"{', '.join(n.inputs)} -> {', '.join(n.outputs)}")
        lines += [f"- {name}: only in this plan" for name in mine if name not in {n.name for n in other.nodes}]
        lines.append(f"objective {self.objective * 1e3:.4f} ms -> {other.objective * 1e3:.4f} ms "
                     f"({(other.objective / self.objective - 1) * 100:+.2f}%)" if self.objective else
                     f"objective {self.objective} -> {other.objective}")
        return "\n".join(lines)

    # -- persistence --------------------------------------------------------------
    def to_json(self) -> str:
        data = {"mesh_shape": list(self.mesh_shape), "axis_names": list(self.axis_names),
                "profile": self.profile, "solver": self.solver, "objective": self.objective,
                "stats": {k: v for k, v in self.stats.items() if _plain(v)},
                "nodes": [asdict(n) for n in self.nodes]}
        return json.dumps(data, indent=1)

    @staticmethod
    def from_json(text: str) -> "Plan":
        d = json.loads(text)
        nodes = [NodePlan(**{**n, "inputs": tuple(n["inputs"]), "outputs": tuple(n["outputs"])})
                 for n in d["nodes"]]
        return Plan(tuple(d["mesh_shape"]), tuple(d["axis_names"]), d["profile"], d["solver"],
                    d["objective"], nodes, d.get("stats", {}))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @staticmethod
    def load(path: str) -> "Plan":
        with open(path) as f:
            return Plan.from_json(f.read())


def _plain(value) -> bool:
    """Whether a stats value is a JSON scalar or a list of them (what a plan file keeps)."""
    scalar = (int, float, str, bool)
    return isinstance(value, scalar) or (isinstance(value, list) and all(isinstance(x, scalar) for x in value))
