"""The README and docs/ say what the code does: every name the code reads, raises or
publishes is on docs/configuration.md, every module path the docs name exists, every
relative link of the README and docs/ reaches a file and its `#anchor` a heading (as GitHub
makes heading anchors), and the README stays short and links every page of docs/.

Each name is drawn from the code itself, so a setting, an error code or a series added
without its row fails here:

- environment variables: the msgspec structs of `appliance/config/schema.py` walked the way its
  loader maps them (`Section__Key`; a list of sections `Section__Key__N__Sub`, the root's
  `Nodes__N__Key`; an indexed section's items `Models__N__Key`; a dict `Profiles__NAME__Key`),
  and every `os.environ` read in `appliance/`. The walk is checked against the loader: each
  name it makes is one `config.load` knows.
- error codes: the `ApiError(status, "code"` literals in `appliance/`.
- series: the `appliance_*` names given to prometheus_client (a counter's with `_total`, as
  it is exposed).
"""

from __future__ import annotations

import ast
import re
import typing
from collections.abc import Set
from pathlib import Path

import msgspec
import pytest

from appliance import config
from appliance.config import _strip  # the loader's own: Annotated[X] -> X, X | None -> X

ROOT = Path(__file__).resolve().parent.parent
CODE = ROOT / "appliance"
DOCS = ROOT / "docs"
README = ROOT / "README.md"
CONFIG_MD = DOCS / "configuration.md"
README_MAX_LINES = 450

# String literals shaped like a series name that are none.
NOT_SERIES = {
    "appliance_hangups": "a trio RunVar's name (appliance/server/send.py)",
    "appliance_version": "a field of the hub's /api/version answer (hub/api/routes.py)",
}
# The prometheus_client constructors whose first argument is a series name, and whether the
# exposed name gains `_total`.
METRIC_CALLS = {"Counter": True, "CounterMetricFamily": True, "Gauge": False,
                "GaugeMetricFamily": False, "Histogram": False, "Summary": False,
                "Info": False}


def _is_struct(tp: typing.Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _walk(cls: type, prefix: list[str]) -> list[str]:
    """The variable names under the Struct `cls`, `prefix` before each."""
    hints = typing.get_type_hints(cls, include_extras=True)
    indexed = getattr(cls, "INDEXED", None)
    out: list[str] = []
    for f in msgspec.structs.fields(cls):
        tp = _strip(hints[f.name])
        origin = typing.get_origin(tp)
        here = prefix if f.name == indexed else [*prefix, f.encode_name]
        if origin is list and _is_struct(_strip(typing.get_args(tp)[0])):
            out += _walk(_strip(typing.get_args(tp)[0]), [*here, "N"])
        elif origin is dict:
            out += _walk(_strip(typing.get_args(tp)[1]), [*here, "NAME"])
        elif _is_struct(tp):
            out += _walk(tp, here)
        else:  # a value, or a comma-separated list of values
            out.append("__".join(here))
    return out


def config_vars() -> list[str]:
    return _walk(config.Config, [])


def environ_vars() -> set[str]:
    """The names `appliance/` reads with os.environ.get / os.environ[...] / os.getenv, and
    the module constants holding such a name."""
    found: set[str] = set()
    for path in CODE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            arg: ast.expr | None = None
            if isinstance(node, ast.Call) and node.args:
                fn = ast.unparse(node.func)
                if fn in ("os.environ.get", "os.getenv", "environ.get"):
                    arg = node.args[0]
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ",
                                                                                "environ"):
                arg = node.slice
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value)
        for name in re.findall(r'^[A-Z_]+_ENV = "([A-Z_]+)"', path.read_text(encoding="utf-8"),
                               re.M):
            found.add(name)
    return found


def error_codes() -> dict[str, str]:
    """code -> one file raising it."""
    out: dict[str, str] = {}
    for path in sorted(CODE.rglob("*.py")):
        for m in re.finditer(r'ApiError\(\s*(\d+)\s*,\s*"([a-z_]+)"', path.read_text("utf-8")):
            out.setdefault(m.group(2), str(path.relative_to(ROOT)))
    return out


def series_names() -> dict[str, str]:
    """Exposed series name -> the file naming it: every `appliance_*` string literal in
    `appliance/` (a counter's gains `_total`), less NOT_SERIES."""
    out: dict[str, str] = {}
    for path in sorted(CODE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        counters: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args:
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if METRIC_CALLS.get(name) and isinstance(node.args[0], ast.Constant):
                    counters.add(id(node.args[0]))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            if not re.fullmatch(r"appliance_[a-z0-9_]*[a-z0-9]", node.value):
                continue
            if node.value in NOT_SERIES:
                continue
            name = node.value
            if id(node) in counters and not name.endswith("_total"):
                name += "_total"
            out.setdefault(name, str(path.relative_to(ROOT)))
    return out


def _code_spans(text: str) -> set[str]:
    """The `code` spans of `text`; a span `a_{b,c}_d` also as `a_b_d` and `a_c_d`, so a row
    may name a family of series at once."""
    spans = set(re.findall(r"`([^`\n]+)`", text))
    for span in list(spans):
        m = re.fullmatch(r"(\w*)\{([\w,]+)\}(\w*)", span)
        if m:
            spans |= {m.group(1) + alt + m.group(3) for alt in m.group(2).split(",")}
    return spans


def missing_vars(doc: str) -> list[str]:
    spans = _code_spans(doc)
    return [v for v in [*config_vars(), *sorted(environ_vars())] if v not in spans]


def missing_codes(doc: str) -> list[str]:
    spans = _code_spans(doc)
    return [f"{c} ({where})" for c, where in error_codes().items() if c not in spans]


def missing_series(doc: str) -> list[str]:
    spans = _code_spans(doc)
    return [f"{s} ({where})" for s, where in series_names().items() if s not in spans]


def readme_problems(readme: str) -> list[str]:
    out = []
    lines = readme.count("\n") + (not readme.endswith("\n"))
    if lines > README_MAX_LINES:
        out.append(f"README.md has {lines} lines (at most {README_MAX_LINES})")
    links = set(re.findall(r"\]\((?:\./)?(docs/[^)#\s]+\.md)(?:#[^)\s]*)?\)", readme))
    for page in sorted(DOCS.glob("*.md")):
        rel = f"docs/{page.name}"
        if rel not in links:
            out.append(f"README.md does not link {rel}")
    return out


def old_paths(architecture: str) -> set[str]:
    """The paths of before the restructure, from architecture.md's table "Where the old files
    went": older pages (profiles, benchmarks) may name them, as they were measured."""
    table = architecture.split("## Where the old files went", 1)[-1].split("\n## ", 1)[0]
    out: set[str] = set()
    for row in re.findall(r"^\| (.+?) \| (.+?) \|$", table, re.M):
        out |= {p for p in _paths(row[0]) if p.startswith("appliance/")}
    return out


def _paths(text: str) -> list[str]:
    """`appliance/....py` paths in `text` (a `{a,b}` group and a `, b.py` after a path
    expanded: `appliance/hub/{a,b}.py`, `appliance/x/a.py`, `b.py`)."""
    out = []
    for m in re.finditer(r"appliance/[\w/{},]+\.py((?:`?, `?[\w]+\.py)*)", text):
        first = m.group(0)[: len(m.group(0)) - len(m.group(1))]
        stems = [first, *(first.rsplit("/", 1)[0] + "/" + b
                          for b in re.findall(r"(\w+\.py)", m.group(1)))]
        for stem in stems:
            out += _braces(stem)
    return out


def _braces(path: str) -> list[str]:
    m = re.search(r"\{([\w,]+)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",")
            for x in _braces(path[: m.start()] + alt + path[m.end():])]


def missing_paths(texts: dict[str, str], old: Set[str] = frozenset()) -> list[str]:
    """Every `appliance/....py` a page names exists, but for the old names of `old`."""
    out = []
    for where, text in texts.items():
        for p in sorted(set(_paths(text))):
            if p not in old and not (ROOT / p).is_file():
                out.append(f"{where}: {p}")
    return out


WALK = "## One streamed chat, file by file"


def walk_problems(architecture: str) -> list[str]:
    """The walk of one streamed chat: at most 12 numbered steps, one file each, none twice;
    every step's file and every helper it names (`x/y.py`, `x/`) exists under appliance/."""
    section = architecture.split(WALK, 1)[-1].split("\n## ", 1)[0]
    out = []
    steps = re.findall(r"^ ?(\d+)\. \*\*`([^`]+)`\*\*", section, re.M)
    files = [f for _, f in steps]
    if not steps:
        out.append("no numbered steps")
    if len(set(files)) > 12:
        out.append(f"{len(set(files))} files in the walk (at most 12)")
    if len(set(files)) != len(files):
        out.append("a file is a step twice")
    named = set(re.findall(r"`((?:[a-z0-9_]+/)+(?:[a-z0-9_]+\.py)?)`", section))
    for f in sorted(set(files) | named):
        if not (CODE / f).exists():
            out.append(f"the walk names appliance/{f}, which does not exist")
    return out


FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF = re.compile(r"^ {0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+.*)?$", re.M)


def _prose(text: str) -> str:
    """A page without its fenced code blocks and inline code spans."""
    return re.sub(r"(`+)(?:(?!\1).)+\1", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower case, without punctuation but `-`
    and `_`, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page: each heading's slug (a repeated one gains -1, -2 ...) and
    any `<a name=...>` / `id=...`."""
    out, seen = set(), {}
    for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", FENCE.sub("", text), re.M):
        s = slug(m.group(1).strip())
        out.add(f"{s}-{seen[s]}" if s in seen else s)
        seen[s] = seen.get(s, 0) + 1
    return out | set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))


def broken_links(texts: dict[str, str]) -> list[str]:
    """Every relative link (inline or reference) of each page (by its path from ROOT)
    reaches a file, and an `#anchor` into a Markdown page one of its anchors."""
    out = []
    for where, text in texts.items():
        for target in [*LINK.findall(_prose(text)), *REF.findall(_prose(text))]:
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (ROOT / where).parent / path
            if path and not dest.exists():
                out.append(f"{where}: {target} (no such file)")
            elif anchor and (not path or dest.suffix == ".md") and anchor not in anchors(
                    dest.read_text(encoding="utf-8") if path else text):
                out.append(f"{where}: {target} (no such heading)")
    return out


def _docs_texts() -> dict[str, str]:
    texts = {"README.md": README.read_text(encoding="utf-8")}
    for page in sorted(DOCS.glob("*.md")):
        texts[f"docs/{page.name}"] = page.read_text(encoding="utf-8")
    return texts


# --- the checks ---------------------------------------------------------------------------


def test_every_variable_is_documented() -> None:
    assert missing_vars(CONFIG_MD.read_text(encoding="utf-8")) == []


def test_every_error_code_is_documented() -> None:
    assert missing_codes(CONFIG_MD.read_text(encoding="utf-8")) == []


def test_every_series_is_documented() -> None:
    assert missing_series(CONFIG_MD.read_text(encoding="utf-8")) == []


def test_readme_is_short_and_links_every_page() -> None:
    assert readme_problems(README.read_text(encoding="utf-8")) == []


def test_every_module_path_named_exists() -> None:
    texts = _docs_texts()
    old = old_paths(texts["docs/architecture.md"])
    assert "appliance/h1server.py" in old
    assert missing_paths(texts, old) == []
    assert [p for p in sorted(old) if (ROOT / p).exists()] == []  # old names are old


def test_every_relative_link_and_anchor_resolves() -> None:
    texts = _docs_texts()
    assert sum(len(LINK.findall(_prose(x))) for x in texts.values()) > 20  # links were read
    assert broken_links(texts) == []


def test_the_walk_is_twelve_files_at_most_and_each_exists() -> None:
    assert walk_problems((DOCS / "architecture.md").read_text(encoding="utf-8")) == []


# --- the checks can fail -------------------------------------------------------------------


def test_the_walk_names_what_the_loader_reads() -> None:
    """Each name the walk makes is one config.load places (a bad value may be refused; an
    unknown key may not), and the walk finds the shapes of every kind."""
    names = config_vars()
    for must in ("Hub__Listen", "Auth__Clients__N__Rpm", "Auth__Clients__N__Weight",
                 "Nodes__N__Url", "Models__N__Engine", "Models__ParkAfterFailures",
                 "Profiles__NAME__Args", "Sim__Models__N__Capabilities",
                 "Hub__WriteStallSeconds", "Router__Affinity"):
        assert must in names
    assert not any("Items" in n for n in names)
    for name in names:
        var = name.replace("__N__", "__0__").replace("__NAME__", "__p__")
        try:
            config.load({var: "1", "Profiles__p__Args": "", "Auth__Clients__0__Key": "k"})
        except config.ConfigError as e:
            msg = str(e)
            assert "unknown key" not in msg and "is a list" not in msg, (name, msg)
            assert "takes no sub-keys" not in msg and "expected an index" not in msg, (name, msg)


def test_environ_reads_are_found() -> None:
    assert {"APPLIANCE_ENV_FILE", "APPLIANCE_HUB_URL", "APPLIANCE_ADMIN_KEY",
            "APPLIANCE_HUB_WORKER"} <= environ_vars()


def test_codes_and_series_are_found() -> None:
    codes = error_codes()
    assert {"rate_limit_exceeded", "preempted", "busy", "invalid_request"} <= set(codes)
    series = series_names()
    for name in ("appliance_requests_total", "appliance_node_fenced", "appliance_tokens_total",
                 "appliance_routing_decisions_total", "appliance_model_ready",
                 "appliance_node_requests_total", "appliance_in_flight"):
        assert name in series
    assert "appliance_requests" not in series and not set(NOT_SERIES) & set(series)


@pytest.mark.parametrize("row", ["`Auth__Clients__N__Rpm`", "`Router__AffinityLoadFactor`",
                                 "`Profiles__NAME__Args`", "`APPLIANCE_HUB_WORKER`"])
def test_a_removed_variable_row_fails(row: str) -> None:
    doc = CONFIG_MD.read_text(encoding="utf-8")
    assert row in doc
    assert row.strip("`") in missing_vars(doc.replace(row, "`gone`"))


@pytest.mark.parametrize("code", ["worker_lost", "preempted", "rate_limit_exceeded",
                                  "node_error"])
def test_a_removed_code_row_fails(code: str) -> None:
    doc = CONFIG_MD.read_text(encoding="utf-8")
    assert any(m.startswith(code + " ") for m in missing_codes(doc.replace(f"`{code}`", "`x`")))


def test_a_removed_series_row_fails() -> None:
    doc = CONFIG_MD.read_text(encoding="utf-8")
    gone = doc.replace("`appliance_node_fenced`", "`x`")
    assert any(m.startswith("appliance_node_fenced ") for m in missing_series(gone))
    # a family written with braces counts each member, and only those
    assert missing_series("`appliance_priority_{held,released}_total`") != []
    assert not any(m.startswith("appliance_priority_held_total ")
                   for m in missing_series("`appliance_priority_{held,released}_total`"))


def test_a_long_or_unlinked_readme_fails() -> None:
    readme = README.read_text(encoding="utf-8")
    assert any("lines" in p for p in readme_problems(readme + "x\n" * README_MAX_LINES))
    page = sorted(DOCS.glob("*.md"))[0].name
    unlinked = re.sub(rf"\]\((?:\./)?docs/{re.escape(page)}", "](elsewhere", readme)
    assert f"README.md does not link docs/{page}" in readme_problems(unlinked)


def test_a_wrong_path_fails() -> None:
    assert missing_paths({"x": "see appliance/hub/nowhere.py"}) == ["x: appliance/hub/nowhere.py"]
    assert missing_paths({"x": "see appliance/config/schema.py"}) == []
    assert missing_paths({"x": "`appliance/hub/{run,nope}.py`"}) == ["x: appliance/hub/nope.py"]
    assert missing_paths({"x": "`appliance/hub/run.py`, `nope.py`"}) == ["x: appliance/hub/nope.py"]
    assert missing_paths({"x": "appliance/h1server.py"}, {"appliance/h1server.py"}) == []


def test_a_wrong_walk_fails() -> None:
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    assert any("does not exist" in p
               for p in walk_problems(text.replace("`hub/api/relay.py`", "`hub/relay.py`")))
    section = text.split(WALK, 1)[1].split("\n## ", 1)[0]
    longer = section + "".join(f"\n{n}. **`x{n}.py`** -- more." for n in range(13, 15))
    assert any("at most 12" in p for p in walk_problems(text.replace(section, longer)))


def test_a_broken_link_or_anchor_fails() -> None:
    assert slug("One HTTP/1.1 stack (issue 19): before and after") == (
        "one-http11-stack-issue-19-before-and-after")
    assert slug("`Hub__Workers` on this box: why [x](y.md)") == "hub__workers-on-this-box-why-x"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}
    page = "# Top\n\n## Run it\n"
    ok = {"README.md": "# Top\n[a](docs/architecture.md#layers-what-may-import-what) [b](#top) "
                       "[c](https://x.invalid/#nope) `[d](nowhere.md)`\n[e]: docs/api.md\n"}
    assert broken_links({**ok, "docs/x.md": page + "[r](#run-it) [up](../README.md)"}) == []
    assert broken_links({"README.md": "[a](docs/nowhere.md)"}) == [
        "README.md: docs/nowhere.md (no such file)"]
    assert broken_links({"README.md": "[a](docs/architecture.md#nowhere)"}) == [
        "README.md: docs/architecture.md#nowhere (no such heading)"]
    assert broken_links({"docs/x.md": page + "[r](#run)"}) == ["docs/x.md: #run (no such heading)"]
    assert broken_links({"docs/x.md": "[e]: ./gone.md\n"}) == ["docs/x.md: ./gone.md (no such file)"]
