"""No import cycle inside tierckpt, type-only imports included.

A cycle works at run time only while every module in it happens to be imported in one order, and
``if TYPE_CHECKING:`` imports turn into real ones the day someone needs the name at run time; a cycle
also means no module in it can be read, tested or moved without the others. So the graph is read from
the source with :mod:`ast` (nothing is imported) and every import counts: at module level, inside a
function, and under ``if TYPE_CHECKING:``.

How an import becomes an edge (the nodes are modules; a package is its ``__init__.py``):

- ``import tierckpt.a.b`` and ``from tierckpt.a.b import name``: an edge to ``tierckpt.a.b``; when
  ``name`` is itself a submodule (``from tierckpt.a import b``), the edge goes to that submodule
  instead. Relative imports are resolved against the importing module's package first.
- ``from tierckpt.pkg import name`` where ``name`` is not a submodule: an edge to the package
  ``tierckpt.pkg``, whose ``__init__.py`` has edges to the submodules it re-exports from. So a module
  that takes a name from its own package's ``__init__`` while that ``__init__`` imports the module is
  a cycle, as it is at run time (the module sees a half-initialised package).
- Reaching a submodule runs the ``__init__.py`` of every package on its way, so those are edges too
  (``tierckpt.tiers.stored.read`` importing ``tierckpt.format.layout`` has an edge to ``tierckpt.format``),
  except the packages that hold the importing module itself: Python starts a package's ``__init__``
  before any module inside it, so by then they are running or done, and a module imported by its full
  name needs nothing from them. Counting those would put every package in a cycle with its own
  ``__init__`` (``tierckpt.tiers`` re-exports ``tierckpt.tiers.filesystem``, which imports
  ``tierckpt.tiers.base``), and every module in one with ``tierckpt/__init__.py``, which imports the API.

Strings handed to ``importlib`` are not read: the package has none.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "tierckpt"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def modules(root: Path) -> dict[str, Path]:
    """Every module under the package directory ``root``, by its dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The tierckpt modules that module ``name`` (at ``path``) imports, by the rules above."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    parts = name.split(".")
    own = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}  # itself and the packages holding it
    found: set[str] = set()

    def add(target: str) -> None:
        steps = target.split(".")
        for i in range(1, len(steps) + 1):  # the target and every package on the way to it
            module = ".".join(steps[:i])
            if module in known and module not in own:
                found.add(module)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, or one of the packages above it
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source != PACKAGE and not source.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in known else source)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imported(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The cycles, each as a chain of module names that starts and ends at the same module: those of
    every strongly connected component of more than one module (Tarjan), enough of them that every
    module of the component is in one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    chains = []
    for component in components:
        covered: set[str] = set()
        for start in sorted(component):  # a shortest cycle through each module not yet shown in one
            if start not in covered:
                chain = _chain(start, component, edges)
                covered.update(chain)
                chains.append(chain)
    return chains


def _chain(start: str, members: set[str], edges: dict[str, set[str]]) -> list[str]:
    """The shortest path from ``start`` back to itself inside its component (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(edges[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if w not in came_from:
                    came_from[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def test_every_kind_of_import_is_an_edge(tmp_path: Path) -> None:
    # The reader itself, on a package made for it: a graph with too few edges has no cycle either.
    root = tmp_path / PACKAGE
    files = {
        "__init__.py": "from tierckpt.api import run\n",
        "api.py": "def run() -> None:\n    from tierckpt.low import deep\n",
        "low/__init__.py": "from .deep import value\n",
        "low/deep.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..api import run\n",
        "low/other.py": "from tierckpt.low import deep\nfrom tierckpt.low.deep import value\nimport tierckpt.api\n",
        "mid/__init__.py": "",
        "mid/user.py": "from tierckpt.low import value\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    edges = graph(root)
    assert edges["tierckpt"] == {"tierckpt.api"}
    assert edges["tierckpt.api"] == {"tierckpt.low", "tierckpt.low.deep"}  # inside a function; the package on the way
    assert edges["tierckpt.low"] == {"tierckpt.low.deep"}  # relative
    assert edges["tierckpt.low.deep"] == {"tierckpt.api"}  # type-only, relative two levels up
    assert edges["tierckpt.low.other"] == {"tierckpt.low.deep", "tierckpt.api"}  # not its own package, nor tierckpt
    assert edges["tierckpt.mid.user"] == {"tierckpt.low"}  # a re-exported name: the package's __init__
    assert cycles(edges) == [  # the shortest through api, then one through the package it left out
        ["tierckpt.api", "tierckpt.low.deep", "tierckpt.api"],
        ["tierckpt.low", "tierckpt.low.deep", "tierckpt.api", "tierckpt.low"],
    ]


def test_the_graph_is_read_from_every_module() -> None:
    edges = graph()
    assert "tierckpt.checkpointer" in edges
    assert {"tierckpt.tiers.base", "tierckpt.format"} <= edges["tierckpt.tiers.stored.tier"]


def test_no_import_cycle() -> None:
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(chain) for chain in found)


def test_the_package_imports_its_api_names_when_first_used() -> None:
    """``tierckpt/__init__.py`` imports its names at their first use (PEP 562), so that importing any
    module of the package (``tierckpt --version`` imports tierckpt.cli) does not import torch. Where
    each name lives is written twice there, for the type checker and for ``__getattr__``: the two agree
    with ``__all__``, and each name is its home module's object."""
    import importlib

    import tierckpt

    tree = ast.parse((ROOT / "__init__.py").read_text())
    typed = {
        alias.name: node.module
        for block in tree.body
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    homes = tierckpt._HOMES
    assert typed == homes and sorted(homes) == sorted(tierckpt.__all__)
    for name, home in homes.items():
        assert getattr(tierckpt, name) is getattr(importlib.import_module(home), name), name
    assert set(tierckpt.__all__) <= set(dir(tierckpt))


def test_importing_the_package_imports_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, tierckpt, tierckpt.cli\n"
        "assert 'torch' not in sys.modules, 'import tierckpt imported torch'\n"
        "from tierckpt import Checkpointer, ConfigError\n"
        "assert 'torch' in sys.modules and Checkpointer.__module__ == 'tierckpt.checkpointer'\n"
        "try:\n"
        "    tierckpt.Nonesuch\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "module 'tierckpt' has no attribute 'Nonesuch'\n"), done.stderr
