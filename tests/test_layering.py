"""Layering of the dsflash package (docs/architecture.md, "Floors"): every module imports only its own floor or the
floors below it, nothing imports the package face ``dsflash/__init__``, and there are no import cycles between
modules. Imports are read with ``ast`` (module level and inside functions alike), nothing is imported.

``DSFLASH_LAYERING_ROOT=/some/checkout`` checks another tree (e.g. an older one) instead of this one."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.environ.get("DSFLASH_LAYERING_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# floor -> top-level parts of dsflash (a module "dsflash.<part>" or a subpackage "dsflash.<part>.*")
FLOORS = {
    0: ("config", "quant", "progress", "plots", "environment", "compile_options", "tokenizer", "chat", "engram_map"),
    1: ("kernels",),
    2: ("model",),
    3: ("checkpoint",),
    4: ("sharding",),
    5: ("api",),
    6: ("serve", "llm"),
    7: ("train",),
    8: ("bench",),
}
FACE = "dsflash"          # dsflash/__init__.py: on top, for users only
# compatibility aliases kept for old notebooks: each may import its new home (whatever its floor); nothing in
# dsflash may import them
SHIMS = {"dsflash.model.quant": "dsflash.quant", "dsflash.model.api": "dsflash.api"}


def _modules(root: str) -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(os.path.join(root, "dsflash")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _imports(name: str, path: str, mods: dict[str, str]) -> list[tuple[str, int, bool]]:
    """(imported dsflash module, line, at module level) for every import statement in the file."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    top = {id(n) for n in tree.body}
    is_pkg = path.endswith("__init__.py")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # ``from pkg import sub`` imports the submodule when there is one, else a name of ``pkg``
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
        else:
            continue
        out += [(t, node.lineno, id(node) in top) for t in targets if t.split(".")[0] == "dsflash"]
    return out


def floor_of(mod: str) -> int | None:
    if mod == FACE:
        return max(FLOORS) + 1
    part = mod.split(".")[1]
    for f, parts in FLOORS.items():
        if part in parts:
            return f
    return None


def graph(root: str = ROOT):
    mods = _modules(root)
    return mods, {m: _imports(m, p, mods) for m, p in sorted(mods.items())}


def violations(root: str = ROOT) -> list[str]:
    mods, edges = graph(root)
    bad = []
    for m, imps in edges.items():
        fm = floor_of(m)
        if fm is None:
            bad.append(f"{m}: not in the floor table (add dsflash.{m.split('.')[1]} to FLOORS and the doc)")
            continue
        for t, line, _ in imps:
            where = f"{os.path.relpath(mods[m], root)}:{line}"
            if t == FACE:
                bad.append(f"{where}: {m} imports the package face dsflash/__init__")
            elif t in SHIMS:
                bad.append(f"{where}: {m} imports the compatibility alias {t} (use {SHIMS[t]})")
            elif SHIMS.get(m) == t:
                continue
            elif floor_of(t) is not None and floor_of(t) > fm:
                bad.append(f"{where}: {m} (floor {fm}) imports {t} (floor {floor_of(t)})")
    return bad


def cycles(root: str = ROOT) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan) in the module import graph."""
    _, edges = graph(root)
    adj = {m: sorted({t for t, _, _ in imps if t in edges and t != m}) for m, imps in edges.items()}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in adj[v]:
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
                out.append(sorted(comp))

    for v in adj:
        if v not in index:
            visit(v)
    return out


def test_every_module_is_parsed():
    mods, edges = graph()
    assert "dsflash.model.forward" in mods and "dsflash.kernels.dispatch" in mods
    assert any(t == "dsflash.quant" for t, _, _ in edges["dsflash.model.layers"])


def test_floors():
    bad = violations()
    assert not bad, "imports that look up a floor (docs/architecture.md, Floors):\n  " + "\n  ".join(bad)


def test_no_import_cycles():
    found = cycles()
    assert not found, "import cycles between modules:\n  " + "\n  ".join(" <-> ".join(c) for c in found)


def library_clis(root: str = ROOT) -> list[str]:
    """Modules of the library floors (0-5) that carry a command line (argparse or a ``__main__`` guard): bench
    code belongs in bench/ (checkpoint/'s tools -- __main__.py, the synthetic writer -- are the allowed ones)."""
    out = []
    for m, p in sorted(_modules(root).items()):
        if floor_of(m) is None or floor_of(m) > 5 or m.startswith("dsflash.checkpoint"):
            continue
        src = open(p, encoding="utf-8").read()
        if "import argparse" in src or 'if __name__ == "__main__"' in src:
            out.append(f"{os.path.relpath(p, root)}: {m} has a command line (move it to bench/)")
    return out


def test_no_bench_code_below_serve():
    bad = library_clis()
    assert not bad, "\n  ".join(["command lines in library modules:"] + bad)


@pytest.mark.parametrize("mod,floor", [("dsflash.quant", 0), ("dsflash.kernels.moe_gemm", 1), ("dsflash.api", 5),
                                       ("dsflash.serve.engine.backend", 6), ("dsflash", 9)])
def test_floor_table(mod, floor):
    assert floor_of(mod) == floor
