"""The package layout holds: arrows point down and no file imports itself back through others.

Every import of the project counts, wherever it stands in a file (module level, inside a function,
under ``if TYPE_CHECKING``): a lazy import breaks a cycle at run time but not in the reader's head.
Edges go to the named module only (not to the parents' ``__init__``), as import-linter counts them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "engine", "daemon", "client", "models", "kernels", "proposers", "scorers", "policies", "bench", "gateway"
)  # fmt: skip
BELOW_THE_SERVICE = ("kernels", "models", "proposers", "scorers", "policies", "engine")


def module_files() -> dict[str, Path]:
    """``specsched.<folder>.<module>`` -> file, for every .py file of the installed folders."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT / pkg).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join(["specsched", pkg, *parts])] = path
    return out


def imported_modules(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports, resolved to files: ``from a.b import c`` is ``a.b.c``
    when that is a module, else ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]  # fmt: skip
        found.update(n for n in names if n.startswith("specsched."))
    return {n for n in found if n in known}


def import_graph() -> dict[str, set[str]]:
    known = module_files()
    return {mod: imported_modules(path, known) - {mod} for mod, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_and_passes_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


def test_the_import_reader_sees_lazy_and_type_checking_imports(tmp_path):
    known = {"specsched.engine.request": Path("r"), "specsched.daemon": Path("d")}
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from specsched.daemon import Server\n"
        "def f():\n    from specsched.engine import request\n"
    )
    assert imported_modules(src, known) == {"specsched.daemon", "specsched.engine.request"}


def test_nothing_below_the_service_imports_the_daemon_or_the_client():
    graph = import_graph()
    bad = sorted(
        f"{mod} imports {dep}"
        for mod, deps in graph.items()
        if mod.split(".")[1] in BELOW_THE_SERVICE
        for dep in deps
        if dep.split(".")[1] in ("daemon", "client")
    )
    assert not bad, "lower layers must not import the service:\n" + "\n".join(bad)


def test_the_engine_is_imported_by_no_lower_layer_except_its_leaf_types():
    # request / config / records / settings / log_schema import nothing of the step loop, so lower
    # layers may use them; the step loop and its parts are above kernels..policies
    leaves = {f"specsched.engine.{m}" for m in ("request", "config", "records", "settings", "log_schema")}
    graph = import_graph()
    bad = sorted(
        f"{mod} imports {dep}"
        for mod, deps in graph.items()
        if mod.split(".")[1] in ("kernels", "models", "proposers", "scorers", "policies")
        for dep in deps
        if dep.startswith("specsched.engine.") and dep not in leaves
    )
    assert not bad, "\n".join(bad)
    leaf_imports = {dep for leaf in leaves for dep in graph[leaf]}
    assert leaf_imports <= leaves, f"the shared types must import only each other: {sorted(leaf_imports)}"


def test_no_import_cycle_between_files():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_client_imports_with_torch_and_transformers_blocked():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers', 'triton', 'numpy', 'sqlite_utils'):\n"
        "            raise ImportError(f'blocked: {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from specsched.client import AsyncClient, Client, Completion, ServerError\n"
        "import specsched.client.async_client, specsched.client.core, specsched.client.transport\n"
        "print('ok', sorted(m for m in sys.modules if m.startswith('specsched')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")
    assert "specsched.engine" not in out.stdout


def test_the_old_client_import_path_still_works_and_warns():
    import warnings

    import specsched.daemon as daemon
    from specsched.client import Client

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert daemon.Client is Client
    assert any(issubclass(w.category, DeprecationWarning) and "specsched.client" in str(w.message)
               for w in caught)  # fmt: skip


def test_the_gateway_uses_only_the_client_and_the_protocol_and_nothing_uses_it():
    graph = import_graph()
    allowed = ("specsched.gateway", "specsched.client")
    bad = sorted(
        f"{mod} imports {dep}"
        for mod, deps in graph.items()
        if mod.startswith("specsched.gateway")
        for dep in deps
        if not dep.startswith(allowed) and dep != "specsched.daemon.protocol"
    )
    bad += sorted(
        f"{mod} imports {dep}"
        for mod, deps in graph.items()
        if not mod.startswith("specsched.gateway")
        for dep in deps
        if dep.startswith("specsched.gateway")
    )
    assert not bad, "the gateway is a protocol client on top:\n" + "\n".join(bad)


def test_the_gateway_imports_and_builds_its_app_with_torch_and_the_engine_blocked():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        top = name.split('.')[0]\n"
        "        if top in ('torch', 'transformers', 'triton', 'numpy') or name.startswith(\n"
        "                ('specsched.engine', 'specsched.models', 'specsched.daemon.server')):\n"
        "            raise ImportError(f'blocked: {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import specsched.gateway.cli\n"
        "from specsched.gateway.app import create_app\n"
        "from specsched.gateway.config import GatewayConfig\n"
        "create_app(GatewayConfig())\n"
        "print('ok', sorted(m for m in sys.modules if m.startswith('specsched')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok") and "specsched.gateway.app" in out.stdout
