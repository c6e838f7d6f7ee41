"""The import boundaries of README "Development": read from the code's AST, so a new import
that crosses a layer fails here (lazy imports inside functions count too).

- `appliance.h1` (sans-I/O HTTP/1.1) imports nothing of the project and no I/O library.
- `appliance.net` (byte transports over sockets) imports nothing of the project.
- `appliance.http` (app helpers) imports nothing of the project but itself and `h1`; the
  server and client packages build on those and `net`, never the other way, and neither
  imports the other.
- The shared modules (every package but the roles and the launchers) import no role.
- The node and the sim import nothing of the hub (nor of each other -- but the node's
  `sim` engine, which runs the simulator in-process -- nor of cluster);
  the hub imports nothing of the node or the sim.
- The decision cores import no trio, no HTTP library and no role shell: only the other
  cores, the configuration, the wire types, `appliance.http.errors` and `.lines`.
- Nothing under `appliance.hub.decide` imports prometheus_client: its series are read at
  scrape time from hub/observe/.
- No import cycles, counting type-only imports (`if TYPE_CHECKING:`) and imports inside
  functions: a cycle hidden from the interpreter still ties the modules together for a
  reader and for every refactoring.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "appliance"

HUB = ("appliance.hub",)
NODE = ("appliance.node",)
SIM = ("appliance.sim",)
LAUNCHERS = ("appliance.cli", "appliance.up", "appliance.ctl", "appliance.__main__")
ROLES = HUB + NODE + SIM + LAUNCHERS

CORES = ("appliance.config", "appliance.wire", "appliance.bounds", "appliance.http.errors",
         "appliance.http.lines",
         "appliance.hub.decide.priority", "appliance.hub.decide.slots",
         "appliance.hub.decide.placement", "appliance.hub.decide.fit",
         "appliance.hub.decide.demand",
         "appliance.node.state", "appliance.node.health", "appliance.node.routed",
         "appliance.hub.cluster.state", "appliance.hub.decide.shared", "appliance.hub.decide.cost",
         "appliance.hub.translate",
         "appliance.hub.decide.fair", "appliance.hub.decide.home", "appliance.hub.decide.limits", "appliance.hub.decide.ratelimit",
         "appliance.hub.decide.affinity", "appliance.hub.decide.capable",
         "appliance.hub.decide.catalog", "appliance.hub.decide.holds",
         "appliance.hub.decide.actions", "appliance.hub.decide.lanes")
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
                # `from appliance import simtools` imports the module appliance.sim.tools;
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
    assert "appliance.hub.api.router" in MODULES and "appliance.node.app" in MODULES
    assert "appliance.http.errors" in MODULES["appliance.hub.api.router"]
    assert violations(("appliance.hub.api.router",), ("appliance.http",)) != []


# Imports of the shared HTTP packages that point the wrong way: none (issue 19 removed them).
HTTP_DEBTS: list[str] = []


def test_sans_io_wire_imports_nothing_of_the_project_and_no_io():
    assert violations(("appliance.h1",), ("appliance", *SHELL_LIBS), ("appliance.h1",)) == []


def test_transports_import_nothing_of_the_project():
    assert violations(("appliance.net",), ("appliance",), ("appliance.net",)) == []


def test_http_layers_point_one_way():
    found = (violations(("appliance.http",), ("appliance",), ("appliance.http", "appliance.h1"))
             + violations(("appliance.client",), ("appliance.server",))
             + violations(("appliance.server",), ("appliance.client",)))
    assert sorted(found) == HTTP_DEBTS


def test_shared_modules_import_no_role():
    shared = tuple(m for m in MODULES if m != "appliance" and not under(m, ROLES))
    assert "appliance.http.asgi" in shared and "appliance.client.upstream" in shared
    assert violations(shared, ROLES) == []


def test_node_imports_nothing_of_hub_or_sim():
    assert violations(NODE, HUB + SIM + LAUNCHERS) == [
        # Engine__Kind=sim: the node runs the simulator in its own process (by design).
        "appliance.node.engines.sim imports appliance.sim.server"]


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


def test_decide_imports_no_prometheus_client():
    assert under("prometheus_client.core", ("prometheus_client",))
    assert violations(("appliance.hub.decide",), ("prometheus_client",)) == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def test_cycle_finder_finds_cycles_through_any_path():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"d"}, "d": {"c"}}) == [["c", "d"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# Cycles still in the tree: none (the server's listener and connection were one cycle
# until issue 19 made them one package that points one way).
CYCLE_DEBTS: list[list[str]] = []


def test_no_import_cycles_type_only_and_lazy_imports_included():
    graph = {m: {n for n in names if n in MODULES and n != m} for m, names in MODULES.items()}
    # The walk sees the imports an interpreter skips: hub/api/app.py names `Hub` only
    # under TYPE_CHECKING.
    assert "appliance.hub.hub" in graph["appliance.hub.api.app"]
    assert cycles(graph) == CYCLE_DEBTS
