"""Imports run one way: the package's modules form layers, and no module imports one above it.

The test reads every module of ``rfmem_fast`` with :mod:`ast` (no import is executed), takes
every ``import`` and ``from ... import`` at module level AND inside functions, classes and
``if``/``try`` blocks (relative imports resolved against the importing module), keeps the
imports of package-internal modules, and checks the resulting graph:

* no cycle (a strongly connected component of more than one module, or a module importing
  itself) — each one is reported with its edges;
* no upward import: a module imports modules of its own layer or of a lower one only.

Optional third-party packages (torch, ray, fastapi, ...) are outside the graph and so always
allowed. ``from . import name`` / ``from .pkg import name`` count as an import of the
submodule ``pkg.name`` when that file exists, else of the package ``pkg`` (its
``__init__``). Importing a submodule also runs its parent packages' ``__init__`` files; those
implicit edges are not counted (the root ``rfmem_fast/__init__`` is the public facade and
would otherwise be imported by everything): a subpackage ``__init__`` is placed in the layer
of its package and checked like any other module.

The layer table (top to bottom) is :data:`LAYERS`; it is documented in
``docs/internals/layers.md``, and the test checks that page against the table. Run the file
with ``-s`` (or ``python tests/test_layers.py``) to print the table and the edges checked.
"""
from __future__ import annotations

import ast
import fnmatch
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "rfmem_fast"
PAGE = ROOT / "docs" / "internals" / "layers.md"

# Top to bottom. A module belongs to the FIRST layer with a pattern (fnmatch on its dotted
# name without the ``rfmem_fast.`` prefix; the root package is ``rfmem_fast``) that matches it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("commands", (
        "cli", "_cliargs", "bench", "bench.*", "serving.cli", "serving.app", "serving.http_*", "serving.mcp_*",
        "serving.transfer",
    )),
    ("facade, services and tools", (
        "rfmem_fast", "serving", "serving.*", "integrations", "integrations.*",
        "distributed", "distributed.*", "evaluate", "evaluate_datasets", "tuning", "tuning_datasets", "tuning_second_stage", "tuning_pipeline",
        "routing", "routing.calibrate",
    )),
    ("datasets and encoders", (
        "datasets", "datasets.*", "encoders", "encoder_*", "models", "onnx_export", "metrics",
    )),
    ("search", (
        "search", "search_single", "search_chunk", "search_lexical",
    )),
    ("engine", (
        "routing.*", "recollection", "fusion", "context", "expansion", "second_stage", "second_stage_features",
    )),
    ("backends", (
        "backends", "backends.*",
    )),
    ("primitives", (
        "bank", "bank_*", "store", "store_*", "lexical", "filters", "filters_*", "signals", "config", "device",
        "precision", "kmeans", "threads", "_validate", "_optional", "_paths", "_native",
    )),
]

def module_files() -> dict[str, Path]:
    """Every module of the package: dotted name (``rfmem_fast.x.y``) -> its file.

    Python files are read; compiled extensions (``_native*.so`` / ``.pyd``) are modules
    that import nothing of the package.
    """
    out = {}
    paths = sorted(PKG.rglob("*.py")) + sorted(p for ext in ("*.so", "*.pyd") for p in PKG.rglob(ext))
    for path in paths:
        rel = path.relative_to(ROOT)
        parts = list(rel.parent.parts) + [rel.name.split(".")[0]]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_package(name: str, files: dict[str, Path]) -> bool:
    return files[name].name == "__init__.py"


def _resolve(name: str | None, level: int, importer: str, files: dict[str, Path]) -> str | None:
    """The absolute dotted name a (possibly relative) ``from``/``import`` names."""
    if level == 0:
        return name
    base = importer.split(".")
    if not _is_package(importer, files):
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _target(dotted: str, files: dict[str, Path]) -> str | None:
    """The package-internal module ``dotted`` refers to (longest existing prefix), or None."""
    if not (dotted == "rfmem_fast" or dotted.startswith("rfmem_fast.")):
        return None
    parts = dotted.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in files:
            return cand
        parts = parts[:-1]
    return None


class _Imports(ast.NodeVisitor):
    """Collects ``(target, line, scope)`` of every import; ``scope`` is the qualname of the
    enclosing function ("" at module level; classes and ``if`` / ``try`` blocks are walked)."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.AST, str]] = []
        self._stack: list[str] = []
        self._funcs = 0

    def _scoped(self, node, is_func: bool) -> None:
        self._stack.append(node.name)
        self._funcs += is_func
        self.generic_visit(node)
        self._funcs -= is_func
        self._stack.pop()

    def visit_FunctionDef(self, node):  # noqa: N802
        self._scoped(node, True)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):  # noqa: N802
        self._scoped(node, False)

    def visit_Import(self, node):  # noqa: N802
        self.found.append((node, ".".join(self._stack) if self._funcs else ""))

    visit_ImportFrom = visit_Import


def import_edges(files: dict[str, Path] | None = None) -> set[tuple[str, str, int, str]]:
    """``(importer, imported, line, scope)`` of every package-internal import, at any depth.

    ``scope``: the qualname of the function holding the import ("" at module level).
    """
    files = files or module_files()
    edges: set[tuple[str, str, int, str]] = set()
    for mod, path in files.items():
        if path.suffix != ".py":
            continue
        visitor = _Imports()
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        for node, scope in visitor.found:
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(node.module, node.level, mod, files)
                if base is None:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in files else base)
            for dotted in targets:
                tgt = _target(dotted, files)
                if tgt is not None and tgt != mod:
                    edges.add((mod, tgt, node.lineno, scope))
    return edges


def layer_of(module: str) -> int:
    """Index into :data:`LAYERS` (0 = top) of a dotted module name; KeyError if none matches."""
    short = "rfmem_fast" if module == "rfmem_fast" else module[len("rfmem_fast."):]
    for i, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(short, p) for p in patterns):
            return i
    raise KeyError(f"module {module} is in no layer of LAYERS: add it to the table")


def strongly_connected(nodes: list[str], graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the strongly connected components of ``graph``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    comps.append(sorted(comp))
    return comps


def cycles(edges) -> list[list[str]]:
    """Components with a cycle: more than one module, or a module importing itself.

    ``edges``: tuples whose first two entries are (importer, imported).
    """
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e[0], set()).add(e[1])
    nodes = sorted(set(graph) | {e[1] for e in edges})
    return [c for c in strongly_connected(nodes, graph)
            if len(c) > 1 or c[0] in graph.get(c[0], ())]


def layer_table() -> str:
    """The layer table as text, top to bottom, with the number of modules each layer holds."""
    files = module_files()
    lines = []
    for i, (name, patterns) in enumerate(LAYERS):
        count = sum(1 for m in files if layer_of(m) == i)
        lines.append(f"  {i}  {name:<28} ({count:>2} modules)  {', '.join(patterns)}")
    return "\n".join(lines)


def _where(e) -> str:
    return f"line {e[2]}" + (f", in {e[3]}()" if e[3] else "")


# ----------------------------------------------------------------------------- the checker's own tests


def test_the_checker_finds_a_cycle_and_its_members():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    edges = {(a, b, 1, "") for a, bs in graph.items() for b in bs}
    assert sorted(cycles(edges)) == [["a", "b", "c"], ["e"]]
    assert cycles({("a", "b", 1, ""), ("b", "c", 1, "")}) == []


def test_the_checker_resolves_relative_and_nested_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "rfmem_fast"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("X = 1\n")
    (pkg / "_ext.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    (pkg / "sub" / "__init__.py").write_text("from .leaf import Y\n")
    (pkg / "sub" / "leaf.py").write_text(
        "import os\n"
        "from .. import _ext\n"
        "def f():\n"
        "    from ..low import X\n"      # function level, two dots
        "    from .. import low\n"
        "    import rfmem_fast.sub\n"
        "    return X\n"
        "class C:\n"
        "    try:\n"
        "        from rfmem_fast.low import X as Z\n"
        "    except ImportError:\n"
        "        pass\n"
        "    def m(self):\n"
        "        import rfmem_fast.low\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    files = module_files()
    assert set(files) == {"rfmem_fast", "rfmem_fast._ext", "rfmem_fast.low", "rfmem_fast.sub", "rfmem_fast.sub.leaf"}
    got = {(a, b, scope) for a, b, _, scope in import_edges(files)}
    assert got == {
        ("rfmem_fast.sub", "rfmem_fast.sub.leaf", ""),
        ("rfmem_fast.sub.leaf", "rfmem_fast._ext", ""),
        ("rfmem_fast.sub.leaf", "rfmem_fast.low", "f"),
        ("rfmem_fast.sub.leaf", "rfmem_fast.sub", "f"),
        ("rfmem_fast.sub.leaf", "rfmem_fast.low", ""),  # class body: module level
        ("rfmem_fast.sub.leaf", "rfmem_fast.low", "C.m"),
    }
    assert cycles(import_edges(files)) == [["rfmem_fast.sub", "rfmem_fast.sub.leaf"]]


# ----------------------------------------------------------------------------- the package


def test_every_module_is_in_a_layer():
    missing = []
    for mod in module_files():
        try:
            layer_of(mod)
        except KeyError:
            missing.append(mod)
    assert not missing, f"modules in no layer of LAYERS: {missing}"


def test_no_import_cycle():
    edges = import_edges()
    found = cycles(edges)
    report = []
    for comp in found:
        members = set(comp)
        inner = sorted(f"    {e[0]} -> {e[1]} ({_where(e)})" for e in edges if e[0] in members and e[1] in members)
        report.append(f"  cycle of {len(comp)} modules: {', '.join(comp)}\n" + "\n".join(inner))
    assert not found, "import cycles:\n" + "\n".join(report)


def test_no_upward_import():
    edges = import_edges()
    up = sorted(
        f"  {e[0]} ({LAYERS[layer_of(e[0])][0]}) -> {e[1]} ({LAYERS[layer_of(e[1])][0]}), {_where(e)}"
        for e in edges if layer_of(e[1]) < layer_of(e[0])
    )
    pairs = {(e[0], e[1]) for e in edges}
    inner = sum(1 for e in edges if e[3])
    print(f"\nlayers, top to bottom (a module imports its own layer or a lower one):\n{layer_table()}")
    print(f"{len(pairs)} module-to-module import edges checked ({len(edges)} import statements, "
          f"{inner} of them inside functions) across {len(module_files())} modules: "
          f"{len(up)} upward, {len(cycles(edges))} cycles")
    assert not up, "upward imports:\n" + "\n".join(up)


def test_moved_names_resolve_at_their_old_places():
    """Names moved down to untie the layers keep working: the old module re-exports the same
    object silently. The aliases that pointed up a layer (``rfmem_fast.router``,
    ``store.save_bank`` / ``load_bank``, ``RFMemConfig.resolved_router`` / ``resolved_reranker``)
    were removed, so no import is exempt from the layer and cycle checks."""
    import importlib
    import warnings

    silent = {  # old place -> new place, the same object, no warning
        "rfmem_fast.backends.base:BankView": "rfmem_fast.device:BankView",
        "rfmem_fast.recollection:RecollectionOutput": "rfmem_fast.backends.base:RecollectionOutput",
        "rfmem_fast.recollection:recollection_capacity": "rfmem_fast.backends.base:recollection_capacity",
        "rfmem_fast.backends.exact:row_norm_max": "rfmem_fast.precision:row_norm_max",
        "rfmem_fast.backends.exact:gamma": "rfmem_fast.precision:gamma",
        "rfmem_fast.backends.exact:U32": "rfmem_fast.precision:U32",
        "rfmem_fast.backends.exact:abs_error_term": "rfmem_fast.precision:abs_error_term",
        "rfmem_fast.encoders:default_model_path": "rfmem_fast.models:default_model_path",
        "rfmem_fast.serving.cli:open_memory": "rfmem_fast.serving.launch:open_memory",
    }

    def get(spec):
        mod, name = spec.split(":")
        return getattr(importlib.import_module(mod), name)

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for old, new in silent.items():
            assert get(old) is get(new), old
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("rfmem_fast.router")
    from rfmem_fast import RFMemConfig, store

    assert not hasattr(store, "save_bank") and not hasattr(store, "load_bank")
    assert not hasattr(RFMemConfig, "resolved_router") and not hasattr(RFMemConfig, "resolved_reranker")


def test_the_layers_page_lists_the_table():
    text = PAGE.read_text(encoding="utf-8")
    for name, patterns in LAYERS:
        assert name in text, name
        for p in patterns:
            assert f"`{p}`" in text, f"{p} (layer {name}) is not on {PAGE.name}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-s", "-p", "no:cacheprovider"]))
