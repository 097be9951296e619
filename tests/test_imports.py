"""The import graph of ddlc/, passes/ and cost_models/, read from the source with ast: no
import cycles, and imports flow one way through the layers (ddlc/pipeline.py's docstring,
shared/DESIGN.md).

Nodes are the project's files; an edge says that running one runs the other first:

- imports inside functions count (they run when the function does); imports under
  ``if TYPE_CHECKING:`` do not; relative imports are resolved, and so are
  ``importlib.import_module`` calls on a string or on an f-string over a module-level
  dict of strings (any other dynamic import fails the cycle test: it cannot be followed);
- ``import a.b.c`` and ``from a.b import c`` run a/__init__.py and a/b/__init__.py first,
  so they have edges to those packages too ("implicit" edges), except to the importer's
  own packages, which are already running when it does;
- a package's __init__ is two nodes: ``pkg`` (its module-level imports) and ``pkg:lazy``
  (the imports inside its functions: ddlc's PEP 562 ``__getattr__``), which runs only when
  a name the package does not bind at module level is taken from it: ``from pkg import
  name`` for such a name (not a submodule), ``from pkg import *`` or ``import pkg``.
"""
from __future__ import annotations

import ast
import itertools
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ddlc", "passes", "cost_models")
LAZY = ":lazy"

#: Lowest first: a module may import modules of its own layer and of the layers below.
#: A member ending in "." holds every module of that package.
LAYERS = (
    ("core", ("ddlc.ir", "ddlc.sbp", "ddlc.mesh", "ddlc.errors", "ddlc.plan", "ddlc.printing",
              "ddlc.comm", "ddlc.model_state", "ddlc.optim", "ddlc.options", "ddlc.portable", "ddlc.rng",
              "ddlc.fake", "ddlc.sources", "ddlc.fused_update")),
    ("cost_models", ("cost_models", "cost_models.")),
    ("passes", ("passes", "passes.", "ddlc.forward_rewrites", "ddlc.graph_checks", "ddlc.host_random", "ddlc.tracing",
                "ddlc.updates", "ddlc.strided_views")),
    ("pipeline", ("ddlc.pipeline",)),
    ("runtime", ("ddlc.holding", "ddlc.inductor", "ddlc.random_stream", "ddlc.ranks", "ddlc.runtime",
                 "ddlc.simulate", "ddlc.step")),
    ("public", ("ddlc", "ddlc.__main__", "ddlc.calibrate", "ddlc.cli", "ddlc.factory", "ddlc.launch",
                "ddlc.picture", "ddlc.report", "ddlc.zoo")),
)


def _sources(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    found = {}
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, scope: str = "module"):
    """(node, scope) for every node that can run: scope is "module", "class" (a class body;
    it runs at import time) or "function"; ``if TYPE_CHECKING:`` bodies are left out."""
    yield node, scope
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        children = node.orelse
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        for outer in [*getattr(node, "decorator_list", []), node.args]:
            yield from _walk(outer, scope)
        for child in node.body if isinstance(node.body, list) else [node.body]:
            yield from _walk(child, "function")
        return
    elif isinstance(node, ast.ClassDef):
        for outer in [*node.decorator_list, *node.bases, *node.keywords]:
            yield from _walk(outer, scope)
        for child in node.body:
            yield from _walk(child, "function" if scope == "function" else "class")
        return
    else:
        children = ast.iter_child_nodes(node)
    for child in children:
        yield from _walk(child, scope)


def _bound_at_module_level(tree: ast.Module) -> set[str]:
    names = set()
    for node, scope in _walk(tree):
        if scope != "module":
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _string_dicts(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level ``NAME = {...: "str", ...}`` dicts."""
    found = {}
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and isinstance(stmt.value, ast.Dict):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            values = stmt.value.values
            if len(targets) == 1 and isinstance(targets[0], ast.Name) and all(
                    isinstance(v, ast.Constant) and isinstance(v.value, str) for v in values):
                found[targets[0].id] = [v.value for v in values]
    return found


def _strings(expr: ast.expr, dicts) -> list[str] | None:
    """Every string ``expr`` can be, or None if that is not known statically."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return [expr.value]
    if not isinstance(expr, ast.JoinedStr):
        return None
    parts = []
    for value in expr.values:
        if isinstance(value, ast.Constant):
            parts.append([value.value])
        elif isinstance(value, ast.FormattedValue) and value.format_spec is None and \
                isinstance(value.value, ast.Subscript) and isinstance(value.value.value, ast.Name) and \
                value.value.value.id in dicts:
            parts.append(dicts[value.value.value.id])
        else:
            return None
    return ["".join(p) for p in itertools.product(*parts)]


def _absolute(name: str, anchor: str) -> str:
    """``name`` (maybe relative: leading dots) resolved against package ``anchor``."""
    level = len(name) - len(name.lstrip("."))
    if not level:
        return name
    base = anchor.split(".")[:len(anchor.split(".")) - (level - 1)]
    return ".".join(base + ([name[level:]] if name[level:] else []))


def _imports(name: str, path: Path, package: bool):
    """(line, statement text, in a function, absolute module or None if unresolvable,
    imported names or None for ``import module``) for every import ``path`` runs."""
    tree = ast.parse(path.read_text(), str(path))
    anchor = name if package else name.rpartition(".")[0]
    dicts = _string_dicts(tree)
    for node, scope in _walk(tree):
        where = lambda: (node.lineno, ast.unparse(node), scope == "function")  # noqa: E731
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield *where(), alias.name, None
        elif isinstance(node, ast.ImportFrom):
            module = _absolute("." * node.level + (node.module or ""), anchor)
            yield *where(), module, tuple(a.name for a in node.names)
        elif isinstance(node, ast.Call) and (call := _import_call(node)):
            target, package_expr = call
            targets = _strings(target, dicts) if target else None
            relative_to = package_expr and (
                (name if package_expr.id == "__name__" else anchor)
                if isinstance(package_expr, ast.Name) and package_expr.id in ("__name__", "__package__")
                else (_strings(package_expr, dicts) or [None])[0])
            if targets is None or (not relative_to and any(t.startswith(".") for t in targets)):
                yield *where(), None, None  # not statically known
                continue
            for target in targets:
                yield *where(), _absolute(target, relative_to or ""), None


def _import_call(call: ast.Call):
    """(name, package) expressions of an ``importlib.import_module`` or ``__import__`` call."""
    f, keywords = call.func, {k.arg: k.value for k in call.keywords}
    name = (call.args[:1] or [keywords.get("name")])[0]
    if (isinstance(f, ast.Attribute) and f.attr == "import_module" and isinstance(f.value, ast.Name)
            and f.value.id == "importlib") or (isinstance(f, ast.Name) and f.id == "import_module"):
        return name, (call.args[1:2] or [keywords.get("package")])[0]
    if isinstance(f, ast.Name) and f.id == "__import__":
        return name, None
    return None


def _packages_of(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path = ROOT):
    """(graph, unresolvable dynamic imports). Every edge carries ``why``: a list of
    (implicit, "file:line: statement")."""
    sources = _sources(root)
    packages = {n for n, (_, package) in sources.items() if package}
    bound = {n: _bound_at_module_level(ast.parse(sources[n][0].read_text())) for n in packages}
    graph, unresolved = nx.DiGraph(), []
    graph.add_nodes_from(sources)
    graph.add_nodes_from(p + LAZY for p in packages)
    for name, (path, package) in sources.items():
        running = set(_packages_of(name)) | ({name} if package else set())  # already started
        for line, text, in_function, module, names in _imports(name, path, package):
            source = name + LAZY if package and in_function else name
            where = f"{path.relative_to(root)}:{line}: {text}"
            if module is None:
                unresolved.append(where)
                continue
            edges = [(p, True) for p in _packages_of(module)]  # run before the module itself
            if names is None:  # import module
                edges += [(module, False), (module + LAZY, False)]
            else:
                values = [n for n in names if f"{module}.{n}" not in sources]
                edges += [(module, not values)] + [(f"{module}.{n}", False) for n in names if n not in values]
                if module in packages and any(n == "*" or n not in bound[module] for n in values):
                    edges.append((module + LAZY, False))
            for target, implicit in edges:
                if target in graph and target != source and not (implicit and target in running):
                    if not graph.has_edge(source, target):
                        graph.add_edge(source, target, why=[])
                    graph.edges[source, target]["why"].append((implicit, where))
    return graph, unresolved


def _because(graph, source, target) -> str:
    implicit, where = graph.edges[source, target]["why"][0]
    return f"{where}" + ("  (runs the package's __init__)" if implicit else "")


def test_no_import_cycles():
    graph, unresolved = import_graph()
    assert not unresolved, "dynamic imports this test cannot follow:\n" + "\n".join(unresolved)
    cycles = []
    for component in nx.strongly_connected_components(graph):
        if len(component) > 1:
            cycle = nx.find_cycle(graph.subgraph(component))
            cycles.append("\n".join(f"  {a} -> {b}   {_because(graph, a, b)}" for a, b in cycle))
    assert not cycles, "import cycles:\n" + "\n\n".join(sorted(cycles))


def _layer(node: str) -> int | None:
    name = node.removesuffix(LAZY)
    for i, (_, members) in enumerate(LAYERS):
        if any(name == m or (m.endswith(".") and name.startswith(m)) for m in members):
            return i
    return None


def _top(node: str) -> str:
    return node.removesuffix(LAZY).split(".")[0]


def test_imports_flow_down_the_layers():
    """A module imports only its own layer and those below; importing a package counts as
    importing what its __init__ imports; ddlc.pipeline is the only module of ddlc that
    imports passes."""
    graph, _ = import_graph()
    missing = sorted(n for n in graph if _layer(n) is None)
    assert not missing, f"modules missing from LAYERS: {missing}"
    problems = {}  # (importer, imported) -> how, the first way found

    def check(source, target, how):
        if _layer(target) > _layer(source):
            problems.setdefault((source, target), f"{source} ({LAYERS[_layer(source)][0]}) imports "
                                                  f"{target} ({LAYERS[_layer(target)][0]}):\n    {how}")

    def check_running(source, package, how, seen=()):  # what running the package's __init__ imports
        for _, target, data in graph.out_edges(package, data=True):
            for implicit, where in data["why"]:
                then = f"{how}\n    which runs {package}'s __init__: {where}"
                if not implicit:
                    check(source, target, then)
                elif target not in seen:
                    check_running(source, target, then, (*seen, package))

    for source, target, data in graph.edges(data=True):
        for implicit, where in data["why"]:
            if implicit:
                check_running(source, target, where)
                continue
            check(source, target, where)
            if _top(source) == "ddlc" and source != "ddlc.pipeline" and _top(target) == "passes":
                problems.setdefault((source, target), f"{source} imports {target}; only ddlc.pipeline "
                                                      f"imports passes:\n    {where}")
    assert not problems, "imports against the layering:\n" + "\n".join(sorted(problems.values()))
