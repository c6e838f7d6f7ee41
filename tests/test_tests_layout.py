"""The suite's own layout (tests/harness/ is the shared part): every folder of tests is a
package, so two test files may share a basename, and the folders mirror appliance/ --
besides the harness, the end-to-end fleets and the packaging checks."""

from tests.harness import ROOT

TESTS = ROOT / "tests"
OWN = {"harness", "e2e", "packaging"}  # folders with no package of their own to mirror


def folders() -> list:
    return sorted(d for d in TESTS.rglob("*") if d.is_dir() and any(d.glob("*.py")))


def test_every_test_folder_is_a_package():
    assert folders(), "no test folders found"
    missing = [str(d.relative_to(ROOT)) for d in folders() if not (d / "__init__.py").exists()]
    assert not missing, f"add an __init__.py to {missing}"


def test_test_folders_mirror_the_package():
    stray = []
    for d in folders():
        rel = d.relative_to(TESTS)
        if rel.parts[0] in OWN:
            continue
        if not (ROOT / "appliance" / rel / "__init__.py").exists():
            stray.append(str(rel))
    assert not stray, f"test folders with no appliance/ package of that name: {stray}"


def test_the_top_holds_only_whole_tree_checks():
    top = sorted(p.name for p in TESTS.glob("test_*.py"))
    # the top holds checks of appliance/'s own top-level modules and of the whole tree
    allowed = {"test_config.py", "test_ctl.py", "test_fuzz.py", "test_docs.py",
               "test_layers.py", "test_tests_layout.py"}
    assert set(top) <= allowed, f"put {sorted(set(top) - allowed)} in the folder of what it tests"


def test_no_test_writes_its_own_fleet_or_chat_helper():
    """One Fleet (tests/harness/fleet.py) and one chat body (`chat_body`) for every test: a
    module-level `class Fleet` or `def chat(` outside the harness is a copy that drifts."""
    import ast

    copies = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.parent.name == "harness":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if (isinstance(node, ast.ClassDef) and node.name == "Fleet") or (
                    isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                    and node.name == "chat"):
                copies.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not copies, f"use tests.harness.fleet (Fleet, Fleet.chat, chat_body): {copies}"


def starts_without_the_fleet(tree) -> list[tuple[int, str]]:
    """Where a module starts an appliance process itself: `procs.hub/node/start(...)` (or
    `x.procs....`), `Procs()` / `Proc(...)`, or a subprocess running `-m appliance`."""
    import ast

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("Procs", "Proc"):
            found.append((node.lineno, f.id))
        elif isinstance(f, ast.Attribute):
            owner = f.value
            named = (owner.id if isinstance(owner, ast.Name)
                     else owner.attr if isinstance(owner, ast.Attribute) else "")
            if named == "procs" and f.attr in ("hub", "node", "start"):
                found.append((node.lineno, f"procs.{f.attr}"))
            elif named == "subprocess" and any(
                    isinstance(c, ast.Constant) and c.value == "appliance"
                    for a in node.args for c in ast.walk(a)):
                found.append((node.lineno, f"subprocess.{f.attr} appliance"))
    return found


def test_every_test_starts_its_processes_through_the_fleet():
    """Tests start hubs, nodes, sims and `up` only through tests/harness/fleet.Fleet
    (start_hub, start_node, start_sim, start, run, ctl): one place that knows how a
    process joins the others, is waited for and is stopped by pid."""
    import ast

    bypass = [f"{path.relative_to(ROOT)}:{line} {what}"
              for path in sorted(TESTS.rglob("*.py")) if path.parent.name != "harness"
              for line, what in starts_without_the_fleet(ast.parse(path.read_text("utf-8")))]
    assert not bypass, f"start processes with tests.harness.fleet.Fleet: {bypass}"


def test_the_fleet_check_sees_each_way_around_the_fleet():
    import ast

    src = ("procs.hub({})\nself.procs.node('a')\nfleet.procs.start('up', {})\nProcs()\n"
           "Proc('hub', {})\nsubprocess.run([sys.executable, '-m', 'appliance', 'hub'])\n"
           "fleet.start_hub({})\nsubprocess.run(['mount', 'x'])\nfleet.run('hub', {})\n")
    assert [line for line, _ in starts_without_the_fleet(ast.parse(src))] == [1, 2, 3, 4, 5, 6]


# Where a unit test may still poll on the wall clock: the kernel's sockets (no event tells a
# CLOSE-WAIT gone).
WALL_CLOCK_POLLS = {"tests/server/test_close_wait.py"}
VIRTUAL_CLOCKS = {"autojump_clock", "mock_clock"}


def real_sleep_polls(tree) -> list[tuple[int, str]]:
    """`while` loops that sleep (trio.sleep, time.sleep) or time out (trio.move_on_after)
    inside a test on the wall clock (no `autojump_clock` argument): a wait that should be an
    event, or virtual."""
    import ast

    found = []
    for test in tree.body:
        if not (isinstance(test, ast.FunctionDef | ast.AsyncFunctionDef)
                and test.name.startswith("test_")):
            continue
        if VIRTUAL_CLOCKS & {a.arg for a in test.args.args}:
            continue
        for loop in ast.walk(test):
            if isinstance(loop, ast.While) and any(
                    isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                    and c.func.attr in ("sleep", "move_on_after")
                    and isinstance(c.func.value, ast.Name)
                    and c.func.value.id in ("trio", "time") for c in ast.walk(loop)):
                found.append((loop.lineno, test.name))
    return found


def test_no_unit_test_polls_with_real_sleeps():
    """A unit test waits on an event (an engine's on_change, a registry's wait_changed) or
    runs on trio's autojump clock; end-to-end tests of real processes may poll, generously."""
    import ast

    polls = [f"{rel}:{line} {name}" for path in sorted(TESTS.rglob("test_*.py"))
             if (rel := str(path.relative_to(ROOT))).split("/")[1] not in ("e2e", "harness")
             and rel not in WALL_CLOCK_POLLS
             for line, name in real_sleep_polls(ast.parse(path.read_text("utf-8")))]
    assert not polls, f"wait on an event or the autojump clock: {polls}"


def test_the_poll_check_sees_a_real_sleep_poll():
    import ast

    src = ("async def test_a():\n    while not done():\n        await trio.sleep(0.05)\n"
           "async def test_b(autojump_clock):\n    while not done():\n        await trio.sleep(1)\n"
           "def test_c():\n    def until():\n        while x:\n            time.sleep(0.01)\n"
           "async def test_d():\n    while not done():\n        await changed.wait()\n"
           "async def test_e():\n    while not done():\n        with trio.move_on_after(0.005):\n"
           "            await changed.wait()\n")
    assert real_sleep_polls(ast.parse(src)) == [(2, "test_a"), (9, "test_c"), (15, "test_e")]
