"""The package's imports run one way, by pipeline stage, and stay inside the package.

Layers, earliest first (docs/architecture.md): the base modules, then convert → models → build → engine →
runtime → serving → measure → demo → the command line. A module imports from its own layer or an earlier
one; ``splitspec.testing`` may import anything and nothing in the product imports it. No module imports
another module's private (``_``) name, no two modules import each other (directly or round a loop), and no
library code finds files through ``__file__`` outside the installed package (the source checkout is not
there after a regular install).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "src" / "splitspec"
BASE = {"__init__", "errors", "config", "drafter_config", "quant", "files", "settings"}
ORDER = ["base", "convert", "models", "build", "engine", "runtime", "serving", "measure", "demo", "cli"]
CLI = {"cli", "cli_parser"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    """The layer of ``splitspec.a.b``: base, a stage package, cli, or testing."""
    top = module.split(".")[1] if "." in module else "__init__"
    if top in BASE:
        return "base"
    if top in CLI:
        return "cli"
    return top


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, imported names) for every splitspec import in ``path``, at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "splitspec"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "splitspec":
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def _package_files() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _resolve(module: str, names: list[str], known: set[str]) -> list[str]:
    """The modules an import statement depends on (``from splitspec.x import y`` where y is a module → x.y)."""
    subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in known]
    return subs or [module]


def test_layer_order_and_no_testing_in_product():
    files = _package_files()
    known = {_module_name(p) for p in files}
    bad = []
    for path in files:
        me = _module_name(path)
        mine = _layer(me)
        if mine == "testing":
            continue
        for line, module, names in _imports(path):
            for dep in _resolve(module, names, known):
                theirs = _layer(dep)
                where = f"{path.relative_to(ROOT)}:{line} imports {dep}"
                if theirs == "testing":
                    bad.append(f"{where} (splitspec.testing is for tests only)")
                elif theirs in ORDER and mine in ORDER and ORDER.index(theirs) > ORDER.index(mine):
                    bad.append(f"{where} ({mine} may not import the later layer {theirs})")
    for path in files:
        if _layer(_module_name(path)) not in ORDER + ["testing"]:
            bad.append(f"{path.relative_to(ROOT)}: in no layer (add it to ORDER)")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_private_names_across_modules():
    files = _package_files() + sorted((ROOT / "bench").rglob("*.py")) + sorted((ROOT / "triton_repo").rglob("*.py"))
    bad = []
    for path in files:
        me = _module_name(path) if PKG in path.parents else None
        for line, module, names in _imports(path):
            for n in names:
                if n.startswith("_") and module != me:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: from {module} import {n}")
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)


def test_no_import_cycles():
    files = _package_files()
    known = {_module_name(p) for p in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        me = _module_name(path)
        deps = set()
        for _, module, names in _imports(path):
            deps.update(d for d in _resolve(module, names, known) if d in known and d != me)
        graph[me] = deps
    # a package's __init__ is imported along with each of its modules: it takes part in no cycle of theirs
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "modules that import each other: " + "; ".join(" ↔ ".join(c) for c in cycles)


def _file_paths_outside_package(path: Path, source: str | None = None) -> list[str]:
    """``Path(__file__)…parents[N]`` / ``….parent.parent`` expressions in ``path`` that leave src/splitspec."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    depth = len(path.relative_to(PKG).parts)  # going up `depth` levels from the file reaches src/
    bad = []
    for node in ast.walk(tree):
        text = ast.unparse(node)
        if "__file__" not in text:
            continue
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents"
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int)):
            up = node.slice.value + 1
        elif isinstance(node, ast.Attribute) and node.attr == "parent" and ".parents" not in text:
            up = text.count(".parent")
        else:
            continue
        if up > depth:
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    return bad


def test_no_paths_into_the_source_checkout():
    bad = [b for p in _package_files() for b in _file_paths_outside_package(p)]
    assert not bad, "library code reaching outside the package through __file__:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, flagged", [
    ("X = Path(__file__).resolve().parents[3] / 'triton_repo'\n", True),
    ("X = Path(__file__).parent.parent.parent / 'eval'\n", True),
    ("X = Path(__file__).resolve().parents[1] / 'demo'\n", False),
    ("X = Path(__file__).parent / 'data'\n", False),
])
def test_the_checkout_rule_flags_what_it_should(source, flagged):
    """A module two levels down (splitspec/serving/x.py): parents[1] is splitspec/, parents[2] is src/."""
    assert bool(_file_paths_outside_package(PKG / "serving" / "x.py", source)) is flagged


def test_the_layer_rule_knows_every_layer():
    assert _layer("splitspec.settings") == "base" and _layer("splitspec.cli_parser") == "cli"
    assert ORDER.index(_layer("splitspec.engine.group")) < ORDER.index(_layer("splitspec.runtime.scheduler"))
