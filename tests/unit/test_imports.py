"""The import graph of ``mstar_dist/`` and ``models/`` (docs/architecture.md §1): no circle, no module using another
module's private names, and the layers point down. A failure names the files: an import that closes a circle (even
one inside a function, or only for type checking), a ``_private`` name reached across modules, or an arrow that
runs back up (the rank loop importing the conductor, the front end importing the rank loop, the runtime reaching a
model family other than through the registry).

Every import is counted: at module level, inside functions, and under ``TYPE_CHECKING``. ``from pkg import name``
depends on ``pkg.name`` when that is a module, else on ``pkg``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("mstar_dist", "models")

@dataclass(frozen=True)
class Import:
    """One import statement's dependency on a first-party module."""

    src: str
    """The importing module."""
    dst: str
    """The imported module (``pkg.mod``), resolved."""
    names: tuple[str, ...]
    """The names taken from it (``from dst import a, b``); empty for ``import dst``."""
    line: int


def module_files() -> dict[str, Path]:
    """Module name -> file, for every module under the first-party roots (a package by its ``__init__``)."""
    out = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(src: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = src.split(".") if is_package else src.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every first-party import of one module, wherever it stands in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ROOTS:
                    out.append(Import(name, alias.name, (), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, path.name == "__init__.py", node)
            if base.split(".")[0] not in ROOTS:
                continue
            taken = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    out.append(Import(name, sub, (), node.lineno))
                else:
                    taken.append(alias.name)
            if taken:
                out.append(Import(name, base, tuple(taken), node.lineno))
    return out


def graph() -> tuple[dict[str, Path], list[Import]]:
    modules = module_files()
    edges = [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]
    return modules, edges


def circles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    succ: dict[str, set[str]] = {}
    for e in edges:
        if e.src != e.dst:
            succ.setdefault(e.src, set()).add(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return found


def _describe_circle(component: list[str], modules: dict[str, Path], edges: list[Import]) -> str:
    inside = set(component)
    arrows = sorted({f"{modules[e.src].relative_to(REPO)}:{e.line} -> {e.dst}" for e in edges
                     if e.src in inside and e.dst in inside and e.src != e.dst})
    return "circle over " + ", ".join(component) + ":\n    " + "\n    ".join(arrows)


def test_no_module_is_in_an_import_circle():
    modules, edges = graph()
    found = circles(edges)
    assert not found, "\n".join(_describe_circle(c, modules, edges) for c in found)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(modules: dict[str, Path], edges: list[Import]) -> list[str]:
    """``from M import _name`` and ``M._name`` (M a module bound by an import), across first-party modules."""
    found = [f"{modules[e.src].relative_to(REPO)}:{e.line}: from {e.dst} import {n}"
             for e in edges for n in e.names if _private(n) and e.dst != e.src]
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        bound = {}  # local name -> the first-party module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in ROOTS and alias.asname:
                        bound[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", node)
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        bound[alias.asname or alias.name] = f"{base}.{alias.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr)
                    and bound.get(node.value.id, name) != name):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {bound[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    modules, edges = graph()
    found = private_uses(modules, edges)
    assert not found, "private names used across modules:\n  " + "\n  ".join(found)


def _area(module: str) -> str:
    """``mstar_dist.worker.worker`` -> ``worker``; ``mstar_dist.events`` -> ``events``; ``models.*`` -> ``models``."""
    parts = module.split(".")
    return "models" if parts[0] == "models" else (parts[1] if len(parts) > 1 else "")


LOWER = {"config", "control", "distributed", "engine", "graph", "topology", "transport", "events", "trace",
         "telemetry", "logs", "heap", "media", "client"}
"""Areas below the processes: they import none of ``worker``, ``conductor``, ``server``, ``runtime``."""

FORBIDDEN = {
    **{area: {"worker", "conductor", "server", "runtime"} for area in LOWER},
    "worker": {"conductor", "server", "runtime"},  # the rank loop never reaches the front end's code
    "conductor": {"worker", "server", "runtime"},  # the conductor core: no rank loop, no HTTP
    "server": {"worker", "runtime"},  # HTTP adapters: no rank loop, no process assembly
    "engine": {"worker", "conductor", "server", "runtime", "models"},  # the engine runs any family's modules
    "transport": {"worker", "conductor", "server", "runtime", "models"},
}
"""Area -> the areas it must not import. Only ``runtime`` (and ``serve.py``, the CLI's entry) imports across the rank
and the front end. ``tools`` (the GGUF import, the bare decode loop) sits beside the zoo: it may read a family's
config or model, and the runtime's areas never import it (the zoo and the scripts do)."""
for area_ in (*LOWER, "worker", "conductor", "server", "runtime"):
    FORBIDDEN.setdefault(area_, set()).add("tools")


def layering_violations(modules: dict[str, Path], edges: list[Import]) -> list[str]:
    found = []
    for e in edges:
        src, dst = _area(e.src), _area(e.dst)
        where = f"{modules[e.src].relative_to(REPO)}:{e.line} imports {e.dst}"
        if dst in FORBIDDEN.get(src, ()):
            found.append(f"{where} ({src}/ never imports {dst}/)")
        if e.src == "mstar_dist.control.messages" and dst == "transport":
            found.append(f"{where} (the wire types never import transports)")
        if (e.src.startswith("mstar_dist.") and dst == "models" and e.src != "mstar_dist.runtime.registry"
                and src != "tools"):
            found.append(f"{where} (the runtime reaches the zoo only through runtime/registry.py)")
        if e.src == "mstar_dist.runtime.registry" and e.dst != "models":
            found.append(f"{where} (the registry module imports ``models`` itself, never a family's modules)")
    return found


def test_the_layers_point_down():
    modules, edges = graph()
    found = layering_violations(modules, edges)
    assert not found, "imports against the layering:\n  " + "\n  ".join(found)


def test_a_planted_circle_private_import_and_upward_arrow_are_caught(tmp_path, monkeypatch):
    """The checks above find what they look for: a copy of the tree with one of each planted fails each check."""
    import shutil

    for root in ROOTS:
        shutil.copytree(REPO / root, tmp_path / root, ignore=shutil.ignore_patterns("__pycache__"))
    engine = tmp_path / "mstar_dist/engine/component.py"
    engine.write_text(engine.read_text() + "\n\ndef _planted():\n    from mstar_dist.worker import worker\n"
                      "    from mstar_dist.conductor.conductor import _Request\n    import models.llama.chat\n"
                      "    return worker._RANK_NAME\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    modules, edges = graph()
    found = circles(edges)
    assert any({"mstar_dist.engine.component", "mstar_dist.worker.worker"} <= set(c) for c in found), found
    privates = private_uses(modules, edges)
    assert any("import _Request" in p for p in privates) and any("worker._RANK_NAME" in p for p in privates)
    layers = layering_violations(modules, edges)
    assert any("engine/ never imports worker/" in v for v in layers)
    assert any("engine/ never imports models/" in v for v in layers)


def _imported_by(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_the_front_end_and_an_intake_do_not_load_the_rank_loop_and_an_intake_no_torch():
    """What each process imports as it starts: the front end serves HTTP and runs the conductor, never the rank's
    loop; an intake parses HTTP and needs no torch."""
    frontend = _imported_by("mstar_dist.runtime.frontend")
    assert not {m for m in frontend if m.startswith("mstar_dist.worker")}, "the front end imports the rank loop"
    intake = _imported_by("mstar_dist.runtime.intake")
    assert "torch" not in intake
    assert not {m for m in intake if m.startswith(("mstar_dist.worker", "mstar_dist.conductor.conductor"))}
