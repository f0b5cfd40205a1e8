"""Issue 21 item 4: every third-party module that ``dsflash/`` imports at run time is a declared dependency.

All ``import`` statements of every module under ``dsflash/`` (module level and inside functions: a lazy
``import httpx`` in the decode role's pull is still needed at run time) are scanned with ``ast``; each
top-level name that is not the standard library or ``dsflash`` must map (``importlib.metadata``) to a
distribution listed in ``pyproject.toml`` ``[project] dependencies``. Excluded: the documented optional,
lazily imported GPU / plotting stacks (``OPTIONAL``)."""
from __future__ import annotations

import ast
import importlib.metadata as md
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPTIONAL = {"jax_triton", "triton", "torch", "matplotlib"}    # extras 'gpu' / 'bench'; imported lazily


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in sorted((ROOT / "dsflash").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for n in names:
                top = n.split(".")[0]
                if top != "dsflash" and top not in sys.stdlib_module_names and top not in OPTIONAL:
                    out.setdefault(top, set()).add(str(f.relative_to(ROOT)))
    return out


def _declared() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {_norm(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) for d in deps}


def test_runtime_imports_are_declared_dependencies():
    dists = md.packages_distributions()
    declared = _declared()
    missing = []
    for mod, files in sorted(_imports().items()):
        cands = {_norm(d) for d in dists.get(mod, [])} or {_norm(mod)}
        if not cands & declared:
            missing.append(f"{mod} (distribution {sorted(cands)}; imported by {sorted(files)[:3]})")
    assert not missing, "imported at run time but not in pyproject.toml [project] dependencies: " + "; ".join(missing)


def test_httpx_is_a_dependency():
    assert "httpx" in _declared()          # --role decode and the router pull / forward with it
