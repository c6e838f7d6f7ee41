"""The import boundaries of README "Development": read from the code's AST, so a new import
that crosses a layer fails here (lazy imports inside functions count too).

- `appliance.http` (the shared HTTP layer) imports nothing of the project but itself.
- The shared modules (appliance/*.py but the launchers and the sim) import no role.
- The node and the sim import nothing of the hub (nor of each other -- but the node's
  `sim` engine, which runs the simulator in-process -- nor of cluster);
  the hub imports nothing of the node or the sim.
- The decision cores import no trio, no HTTP library and no role shell: only the other
  cores, the configuration, the wire types and `appliance.http.errors`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "appliance"

HUB = ("appliance.hub", "appliance.cluster")
NODE = ("appliance.node",)
SIM = ("appliance.sim", "appliance.simcore", "appliance.simtools")
LAUNCHERS = ("appliance.cli", "appliance.up", "appliance.ctl", "appliance.__main__")
ROLES = HUB + NODE + SIM + LAUNCHERS

CORES = ("appliance.config", "appliance.wire", "appliance.bounds", "appliance.http.errors",
         "appliance.hub.priority", "appliance.hub.placement", "appliance.hub.fit",
         "appliance.node.state", "appliance.cluster.state", "appliance.hub.translate")
SHELL_LIBS = ("trio", "httpx", "h11", "hypercorn", "anyio", "prometheus_client")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


ALL = {module_name(p) for p in PKG.rglob("*.py")}


def imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute names), at any depth of the file."""
    tree = ast.parse(path.read_text(), str(path))
    mod = module_name(path)
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            for a in node.names:
                # `from appliance import simtools` imports the module appliance.simtools;
                # `from appliance.config import Config` imports appliance.config
                sub = f"{name}.{a.name}"
                found.add(sub if sub in ALL else name)
    return found


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


MODULES = {module_name(p): imports(p) for p in sorted(PKG.rglob("*.py"))}


def violations(who: tuple[str, ...], forbidden: tuple[str, ...],
               allowed: tuple[str, ...] = ()) -> list[str]:
    out = []
    for mod, names in MODULES.items():
        if not under(mod, who):
            continue
        for n in sorted(names):
            if under(n, forbidden) and not under(n, allowed) and not under(n, (mod,)):
                out.append(f"{mod} imports {n}")
    return out


def test_the_walk_sees_the_tree():
    # A check that finds nothing because it reads nothing would pass: it reads these.
    assert "appliance.hub.router" in MODULES and "appliance.node.app" in MODULES
    assert "appliance.http.errors" in MODULES["appliance.hub.router"]
    assert violations(("appliance.hub.router",), ("appliance.http",)) != []


def test_shared_http_layer_imports_no_project_module_but_itself():
    assert violations(("appliance.http",), ("appliance",), ("appliance.http",)) == []


def test_shared_modules_import_no_role():
    shared = tuple(m for m in MODULES if m.count(".") == 1 and not under(m, ROLES))
    assert "appliance.asgi" in shared and "appliance.upstream" in shared
    assert violations(shared, ROLES) == []


def test_node_imports_nothing_of_hub_or_sim():
    assert violations(NODE, HUB + SIM + LAUNCHERS) == [
        # Engine__Kind=sim: the node runs the simulator in its own process (by design).
        "appliance.node.engines.sim imports appliance.sim"]


def test_sim_imports_nothing_of_hub_or_node():
    assert violations(SIM, HUB + NODE + LAUNCHERS, SIM) == []


def test_hub_imports_nothing_of_node_or_sim():
    assert violations(HUB, NODE + SIM + LAUNCHERS) == []


def test_decision_cores_import_no_trio_no_http_no_shell():
    bad = []
    for mod, names in MODULES.items():
        if not under(mod, CORES):
            continue
        for n in sorted(names):
            if under(n, SHELL_LIBS):
                bad.append(f"{mod} imports {n}")
            elif n.startswith("appliance") and n != "appliance" and not under(n, CORES):
                bad.append(f"{mod} imports {n} (not a core)")
    assert bad == []
