"""The import graph of `featcal/` (docs/layout.md): no circles among its modules, and no import
against the layering of its subpackages.

Every `import` and `from ... import` statement counts, relative ones and those inside functions
too: a lazy import is still a dependency. An edge goes to the module named (`from p import m`
to the submodule `p.m` when there is one, else to `p`); the `__init__` of the packages above it,
which Python runs first, is not an edge of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# featcal's layers, bottom to top: a module may import its own layer and the ones below, never above.
# `featcal` is the package's own __init__ (it names its lazy exports as strings and imports no
# featcal module); `featcal.profiling` is a leaf that every layer may time with.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("featcal", "featcal.profiling"),
    ("featcal.io",),
    ("featcal.data",),
    ("featcal.families",),
    ("featcal.calibration",),
    ("featcal.merging",),
    ("featcal.baselines",),
    ("featcal.evaluation",),
    ("featcal.finetune", "featcal.finetune_lm"),
    ("featcal.tuning",),
)


def package_modules(package_dir: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__) for every .py file under `package_dir`."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join(parts)] = (path, is_package)
    return modules


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports (all import statements, at any depth)."""
    modules = package_modules(package_dir)

    def known(name: str) -> str | None:
        """The package module `name` lies in (itself, or the nearest enclosing package)."""
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]   # the package relative imports start in
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else known(source)
                           for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t is not None and t != name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module, each as
    [m0, m1, ..., m0] (m0 imports m1, ...)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)

    cycles = []
    for component in components:
        inside = set(component)
        start = component[0]
        # shortest way back to `start` inside the component (breadth first)
        came_from: dict[str, str] = {}
        frontier = [start]
        found = None
        while frontier and found is None:
            following = []
            for v in frontier:
                for w in sorted(graph[v] & inside):
                    if w == start:
                        found = v
                        break
                    if w not in came_from:
                        came_from[w] = v
                        following.append(w)
                if found is not None:
                    break
            frontier = following
        path = [start]
        v = found
        while v != start:
            path.append(v)
            v = came_from[v]
        cycles.append([start, *reversed(path[1:]), start])
    return cycles


def layer_of(module: str, layers: tuple[tuple[str, ...], ...]) -> int | None:
    """The index of the layer holding `module` (the longest matching prefix wins)."""
    best, best_len = None, -1
    for i, prefixes in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def layering_violations(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Each import of a module from a higher layer, and each module in no layer."""
    problems = []
    for module in sorted(graph):
        mine = layer_of(module, layers)
        if mine is None:
            problems.append(f"{module}: in no layer (add it to LAYERS and docs/layout.md)")
            continue
        for target in sorted(graph[module]):
            theirs = layer_of(target, layers)
            if theirs is None or theirs > mine:
                problems.append(f"{module} imports {target}, a higher layer "
                                f"({layers[mine][0]} < {layers[theirs][0] if theirs is not None else '?'})")
    return problems


def test_featcal_has_no_import_circles():
    graph = import_graph(ROOT / "featcal")
    assert len(graph) > 40, sorted(graph)
    cycles = find_cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_featcal_imports_follow_the_layering():
    graph = import_graph(ROOT / "featcal")
    problems = layering_violations(graph, LAYERS)
    assert not problems, "imports against the layering:\n" + "\n".join(problems)


def test_layers_named_in_the_docs():
    """docs/layout.md states the same order."""
    text = (ROOT / "docs" / "layout.md").read_text()
    order = " < ".join(", ".join(p.removeprefix("featcal.").removeprefix("featcal") or "featcal" for p in layer)
                       for layer in LAYERS)
    assert order in text, order


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / next(iter(files)).split("/")[0]


def test_the_checker_finds_a_planted_circle(tmp_path):
    """a imports b at module level, b imports a inside a function (relative): a circle, reported."""
    package = _write(tmp_path, {
        "fakepkg/__init__.py": "",
        "fakepkg/a.py": "import fakepkg.b\n",
        "fakepkg/b.py": "def f():\n    from . import a\n    return a\n",
        "fakepkg/c.py": "from fakepkg.a import something\n",
    })
    graph = import_graph(package)
    assert graph["fakepkg.a"] == {"fakepkg.b"} and graph["fakepkg.b"] == {"fakepkg.a"}
    assert graph["fakepkg.c"] == {"fakepkg.a"}
    assert find_cycles(graph) == [["fakepkg.a", "fakepkg.b", "fakepkg.a"]]


def test_the_checker_finds_a_longer_circle_and_an_upward_import(tmp_path):
    package = _write(tmp_path, {
        "fakepkg/__init__.py": "",
        "fakepkg/io/__init__.py": "",
        "fakepkg/io/x.py": "from ..top import y\n",
        "fakepkg/top/__init__.py": "",
        "fakepkg/top/y.py": "from fakepkg.top import z\n",
        "fakepkg/top/z.py": "import fakepkg.io.x as x\n",
    })
    graph = import_graph(package)
    assert find_cycles(graph) == [["fakepkg.io.x", "fakepkg.top.y", "fakepkg.top.z", "fakepkg.io.x"]]
    layers = (("fakepkg", "fakepkg.io"), ("fakepkg.top",))
    assert layering_violations(graph, layers) == [
        "fakepkg.io.x imports fakepkg.top.y, a higher layer (fakepkg < fakepkg.top)"]
    assert layering_violations(graph, (("fakepkg.io",),)) == [
        "fakepkg: in no layer (add it to LAYERS and docs/layout.md)",
        "fakepkg.io.x imports fakepkg.top.y, a higher layer (fakepkg.io < ?)",
        "fakepkg.top: in no layer (add it to LAYERS and docs/layout.md)",
        "fakepkg.top.y: in no layer (add it to LAYERS and docs/layout.md)",
        "fakepkg.top.z: in no layer (add it to LAYERS and docs/layout.md)",
    ]
