"""Pictures of a planned step: ``ddlc plan --svg OUT.svg`` / ``--html OUT.html``.

The picture is a graph of module groups, drawn with networkx and matplotlib (no system
binary needed):

- one box per (phase, module) of rank 0's lowered program, repeated layers collapsed
  into one box (``blocks.[0-11].fc``, see :class:`ddlc.report.Repeats`), coloured by its
  placement (its first parameter's SBP, else its output's) with its SBPs written in it;
- one column per phase (forward, backward, optimizer), boxes top to bottom in the order
  the traced step first runs them; dataflow between the boxes of forward and of backward
  as grey arrows (optimizer updates are independent of each other: no arrows);
- every communicating collective as a red dashed arrow from the box that issues it (the
  module of the last operator before it whose result it reads) to the box that first
  reads its result, labelled with its kind, mesh axis and bytes (collectives along the
  same arrow add up); one whose both ends are the same box, or that gathers a step input
  (a parameter shard), is written beside the box that reads it.

The SVG keeps text as text (``svg.fonttype = none``) and names its parts with ids
(``column:forward``, ``module:forward:blocks.[0-1].fc``, ``collective:...``), so a test
can read it back; with a fixed hash salt and no date it is the same file on every run.
"""
from __future__ import annotations

import html
import io
from collections import defaultdict

import matplotlib
import networkx as nx
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch import fx

from . import comm
from .ir import COLLECTIVE, ORIGIN, is_collective, is_getitem, is_wait
from .plan import Plan
from .printing import format_bytes
from .report import ModuleRow, Repeats

__all__ = ["PHASES", "step_graph", "draw", "write_picture", "html_page"]

PHASES = ("forward", "backward", "optimizer")
_COLOURS = matplotlib.colormaps["tab20"].colors  # pairs: a strong colour, then its light shade
_SVG = {"svg.fonttype": "none", "svg.hashsalt": "ddlc", "font.size": 7}


def _group(node: fx.Node, repeats: Repeats) -> tuple[str, str] | None:
    """The (phase, collapsed module) box of a node, None outside the drawn phases."""
    origin = ORIGIN.get(node)
    if origin is None or origin.phase not in PHASES:
        return None
    return origin.phase, repeats.label(origin.module)[0]


def _is_plumbing(node: fx.Node) -> bool:
    """Communication plumbing: collectives, waits, getitems, ddlc.comm helpers, bucket packing
    (nodes without an origin)."""
    return (is_collective(node) or is_wait(node) or is_getitem(node) or COLLECTIVE.has(node)
            or ORIGIN.get(node) is None
            or (node.op == "call_function" and getattr(node.target, "__module__", "") == comm.__name__))


def _operators_through_plumbing(start: fx.Node, neighbours, repeats: Repeats) -> list[fx.Node]:
    """The operators in a box reached from ``start`` along ``neighbours`` (a node's inputs
    or its users), looking through communication plumbing."""
    stack, found = list(neighbours(start)), []
    while stack:
        node = stack.pop()
        if node.op == "call_function" and _is_plumbing(node):
            stack.extend(neighbours(node))
        elif _group(node, repeats) is not None:
            found.append(node)
    return found


def _issuer(collective: fx.Node, position: dict, repeats: Repeats):
    """The box of the latest non-plumbing operator whose result ``collective`` reads."""
    found = _operators_through_plumbing(collective, lambda n: n.all_input_nodes, repeats)
    return _group(max(found, key=position.__getitem__), repeats) if found else None


def _reader(collective: fx.Node, position: dict, repeats: Repeats):
    """The box of the first non-plumbing operator that reads ``collective``'s result."""
    found = _operators_through_plumbing(collective, lambda n: n.users, repeats)
    return _group(min(found, key=position.__getitem__), repeats) if found else None


def _first_runs(plan: Plan, repeats: Repeats) -> dict[tuple[str, str], int]:
    """(phase, module label) -> the plan position (trace order) of its first node."""
    first: dict[tuple[str, str], int] = {}
    for i, n in enumerate(plan.nodes):
        if n.phase in PHASES:
            first.setdefault((n.phase, repeats.label(n.module)[0]), i)
    return first


def step_graph(plan: Plan, program: fx.GraphModule, rows: list[ModuleRow], repeats: Repeats) -> nx.DiGraph:
    """The picture's graph: boxes (``phase``, ``order``, ``text``, ``placement``) keyed by
    (phase, module label), ``data`` edges within forward and backward, and ``collectives``
    (label lines) on the edges collectives travel along."""
    graph = nx.DiGraph()
    _add_boxes(graph, plan, rows, repeats)
    _add_dataflow(graph, program, repeats)
    _add_collectives(graph, program, repeats)
    return graph


def _add_boxes(graph: nx.DiGraph, plan: Plan, rows: list[ModuleRow], repeats: Repeats) -> None:
    """One box per (phase, module label), in trace order, its text from the plan's row."""
    by_label = {r.module: r for r in rows}
    for box, order in sorted(_first_runs(plan, repeats).items(), key=lambda item: item[1]):
        row = by_label.get(box[1])
        lines = [box[1] + (f"  ×{row.layers}" if row and row.layers > 1 else "")]
        if row is not None:
            lines += [row.parameters] if row.parameters != "-" else []
            lines.append(f"out {row.activation}")
        graph.add_node(box, phase=box[0], order=order, text="\n".join(lines),
                       placement=row.placement if row else "-")


def _add_dataflow(graph: nx.DiGraph, program: fx.GraphModule, repeats: Repeats) -> None:
    """An edge between two boxes of forward (or of backward) where one reads the other."""
    for node in program.graph.nodes:
        dst = _group(node, repeats)
        for arg in node.all_input_nodes:
            src = _group(arg, repeats)
            if (src and dst and src != dst and src[0] == dst[0] != "optimizer"
                    and src in graph and dst in graph):
                graph.add_edge(src, dst, data=True)


def _add_collectives(graph: nx.DiGraph, program: fx.GraphModule, repeats: Repeats) -> None:
    """Each communicating collective on the edge from its issuer's box to its first reader's
    box; collectives of one kind and axis along one edge are counted and their bytes added."""
    nodes = list(program.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    traffic = defaultdict(lambda: [0, 0])
    for node in nodes:
        info = COLLECTIVE.get(node)
        if info is None or not info.communicates:
            continue
        src, dst = _issuer(node, position, repeats), _reader(node, position, repeats)
        src = dst if src is None else src  # gathering an input (a parameter shard): beside its reader
        if src in graph and dst in graph:
            entry = traffic[(src, dst, info.kind, info.axis_name)]
            entry[0] += 1
            entry[1] += info.nbytes
    for (src, dst, kind, axis), (count, nbytes) in traffic.items():
        if not graph.has_edge(src, dst):
            graph.add_edge(src, dst, data=False)
        times = f" ×{count}" if count > 1 else ""
        graph.edges[src, dst].setdefault("collectives", []).append(
            f"{kind} {axis}{times} {format_bytes(nbytes)}")


def _colours(graph: nx.DiGraph) -> dict[str, tuple]:
    """Placement -> colour, in order of first appearance: tab20's ten strong colours, then
    its ten light ones."""
    placements = dict.fromkeys(graph.nodes[n]["placement"] for n in graph.nodes)
    return {p: _COLOURS[(2 * i) % len(_COLOURS) + (i // 10) % 2] for i, p in enumerate(placements)}


def _layered(graph: nx.DiGraph) -> dict:
    """Positions: x the phase's column, y minus the box's rank in its column."""
    pos = {}
    for column, phase in enumerate(PHASES):
        boxes = sorted((n for n in graph.nodes if graph.nodes[n]["phase"] == phase),
                       key=lambda n: graph.nodes[n]["order"])
        pos.update({n: (float(column), -float(rank)) for rank, n in enumerate(boxes)})
    return pos


def _plain(text: str) -> str:
    """``text`` as matplotlib shows it literally: a ``$`` (in a path or a module's name)
    would start TeX math, and an unpaired one fails the drawing."""
    return text.replace("$", r"\$")


def draw(graph: nx.DiGraph, title: str) -> Figure:
    """Lay the graph out (:func:`_layered`) and draw it on a new figure."""
    pos = _layered(graph)
    rows = max((-y for _, y in pos.values()), default=0.0) + 1
    fig = Figure(figsize=(15, 1.2 + 0.55 * rows))
    ax = fig.add_axes((0.01, 0.01, 0.98, 1 - 0.6 / fig.get_figheight()))
    ax.set_axis_off()
    ax.set_xlim(-0.5, len(PHASES) - 0.5)
    ax.set_ylim(-rows + 0.3, 1.0)
    ax.set_title(_plain(title), fontsize=9)
    _draw_columns(ax, graph, pos, rows)
    data = [e for e in graph.edges if graph.edges[e]["data"]]
    nx.draw_networkx_edges(graph, pos, edgelist=data, ax=ax, edge_color="#9a9a9a", width=0.5, alpha=0.6,
                           arrowsize=6, connectionstyle="arc3,rad=0.35", node_size=2500)
    _draw_collectives(ax, graph, pos)
    colours = _colours(graph)
    for placement, colour in colours.items():
        members = [n for n in graph.nodes if graph.nodes[n]["placement"] == placement]
        texts = nx.draw_networkx_labels(graph, pos, ax=ax, labels={n: _plain(graph.nodes[n]["text"]) for n in members},
                                        font_size=6.5, bbox=dict(boxstyle="round,pad=0.3", fc=colour,
                                                                 ec="#444444", lw=0.5))
        for n, text in texts.items():
            text.set_gid(f"module:{n[0]}:{n[1]}")
    handles = [Rectangle((0, 0), 1, 1, fc=c, ec="#444444", lw=0.5) for c in colours.values()]
    ax.legend(handles, [_plain(f"placement {p}") for p in colours], loc="upper right", fontsize=6.5,
              title="box colour", title_fontsize=7)
    return fig


def _draw_columns(ax, graph: nx.DiGraph, pos: dict, rows: float) -> None:
    """A shaded band and a title per phase column."""
    for column, phase in enumerate(PHASES):
        band = Rectangle((column - 0.45, -rows + 0.4), 0.9, rows + 0.2, fc="#f4f4f4", ec="#cccccc", zorder=0)
        band.set_gid(f"column:{phase}")
        ax.add_patch(band)
        ax.text(column, 0.65, phase, ha="center", va="bottom", fontsize=9, weight="bold")


def _draw_collectives(ax, graph: nx.DiGraph, pos: dict) -> None:
    """Red dashed arrows with their labels; a box's own collectives beside it."""
    for (src, dst), lines in ((e, graph.edges[e].get("collectives")) for e in graph.edges):
        if not lines:
            continue
        label = _plain("\n".join(lines))
        gid = f"collective:{src[0]}:{src[1]}->{dst[0]}:{dst[1]}"
        if src == dst:
            x, y = pos[src]
            ax.text(x + 0.2, y, label, color="#c0392b", fontsize=5.5, va="center", gid=gid)
            continue
        nx.draw_networkx_edges(graph, pos, edgelist=[(src, dst)], ax=ax, edge_color="#c0392b",
                               style="dashed", width=1.2, arrowsize=9, node_size=1800,
                               connectionstyle="arc3,rad=0.12")
        texts = nx.draw_networkx_edge_labels(graph, pos, edge_labels={(src, dst): label}, ax=ax,
                                             font_size=5.5, font_color="#c0392b", rotate=False,
                                             connectionstyle="arc3,rad=0.12",
                                             bbox=dict(fc="white", ec="none", alpha=0.8, pad=0.5))
        for text in texts.values():
            text.set_gid(gid)


def write_picture(graph: nx.DiGraph, title: str, path: str) -> None:
    """Draw the graph into ``path``; the format follows its suffix (``.svg``, ``.png``)."""
    with matplotlib.rc_context(_SVG):
        draw(graph, title).savefig(path, metadata={"Date": None} if path.endswith(".svg") else None)


def _svg_text(graph: nx.DiGraph, title: str) -> str:
    buffer = io.StringIO()
    with matplotlib.rc_context(_SVG):
        draw(graph, title).savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def html_page(graph: nx.DiGraph, title: str, report: str) -> str:
    """A self-contained page: the picture as inline SVG above the text report."""
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:1em} pre{font-size:12px}</style></head><body>\n"
            f"<h1>{html.escape(title)}</h1>\n{_svg_text(graph, title)}\n"
            f"<pre>{html.escape(report)}</pre>\n</body></html>\n")
