"""`appliance ctl`: operate a running hub through its admin API.

Theory of operation: one request per command to `APPLIANCE_HUB_URL` (default
http://127.0.0.1:8080) with `APPLIANCE_ADMIN_KEY` as the bearer; a readable table by
default, the hub's JSON with `--json` for scripts. `status` is a deploy gate: its exit code
is 0 only while the fleet is satisfied (every model has what it should have now, nothing
parked, no node lost), 1 otherwise. Exit codes: 0 done / satisfied, 1 not satisfied or the
hub refused the command, 2 usage error or the hub could not be reached. `pull` and `rm`
go through the hub's /api/pull and /api/delete (the admin key), printing the pull's
progress line by line; both exit 1 when any node failed, naming it. `slow` reads
/api/requests/slow (the hour's slowest requests and where their time went). `batches` is
ctlbatches.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.parse
from typing import Any, TextIO

import httpx

from appliance import ctlbatches
from appliance.http.lines import iter_lines

DEFAULT_URL = "http://127.0.0.1:8080"
# The admin API answers from memory; pause/resume wait on a node (10 s there) -- 30 s is ample.
TIMEOUT = httpx.Timeout(30.0, connect=5.0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="appliance ctl",
                                description="Operate a running hub (admin API).")
    options = [
        p.add_argument("--json", action="store_true",
                       help="print the hub's JSON instead of a table"),
        p.add_argument("--url", default=os.environ.get("APPLIANCE_HUB_URL", DEFAULT_URL),
                       help="the hub (APPLIANCE_HUB_URL, default %(default)s)"),
        p.add_argument("--key-file", default="",
                       help="read the admin key from this file (else APPLIANCE_ADMIN_KEY)"),
        p.add_argument("--key", default=None,
                       help="admin key on the command line: visible in the process list; "
                            "prefer --key-file or APPLIANCE_ADMIN_KEY")]
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status",
                   help="models against what they should have now, and nodes; exit 1 if not "
                        "satisfied")
    sub.add_parser("models", help="every model's health")
    sub.add_parser("nodes", help="every node")
    sp = sub.add_parser("slow", help="the slowest requests of the last hour, and where their "
                                     "time went")
    sp.add_argument("--limit", type=int, default=20, help="how many (at most 20)")
    sp = sub.add_parser("retry", help="unpark a model and try it again")
    sp.add_argument("model")
    for action, text in (("cordon", "stop routing to a node"), ("uncordon",
                                                                "route to a node again"),
                         ("pause", "the node refuses new work (its owner's switch)"),
                         ("resume", "undo pause")):
        sub.add_parser(action, help=text).add_argument("node")
    forget = "drop a node now (an announced one returns only by announcing again)"
    sub.add_parser("forget", help=forget).add_argument("node")
    for action, text in (("pull",
                          "pull a model onto every Ollama node (or --node), showing progress"),
                         ("rm", "delete a model from every Ollama node (or --node)")):
        sp = sub.add_parser(action, help=text)
        sp.add_argument("model")
        sp.add_argument("--node", default=None, help="only this node")
    sp = sub.add_parser("batches", help="batches of every key: list, show ID, cancel ID")
    sp.add_argument("action", nargs="?", default="list", choices=("list", "show", "cancel"))
    sp.add_argument("id", nargs="?", default=None)
    _options_anywhere(options, list(sub.choices.values()))
    return p


def _options_anywhere(options: list[argparse.Action],
                      subcommands: list[argparse.ArgumentParser]) -> None:
    """`ctl status --json` as well as `ctl --json status` (the README shows the first):
    every top-level option is accepted after the subcommand too. Each subcommand gets a
    copy whose default is SUPPRESS, so an option given before the subcommand is not reset."""
    for sp in subcommands:
        for a in options:
            if a.nargs == 0:
                sp.add_argument(*a.option_strings, action="store_const", const=a.const,
                                dest=a.dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            else:
                sp.add_argument(*a.option_strings, dest=a.dest, default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) for r in rows)
    return "\n".join(line.rstrip() for line in lines)


def _model_state(m: dict[str, Any]) -> str:
    if m["parked"]:
        return "PARKED"
    if m["unplaceable"]:
        return "UNPLACEABLE"
    if m["ready"] >= m["desired"]:
        return "ok" if m["ready"] or m["desired"] else "idle"
    return "loading" if m["loading"] else "NOT READY"


def routing_cell(r: dict[str, Any] | None) -> tuple[str, str]:
    """(requests placed by session/prefix/spread, the engines' cache hit ratio)."""
    if not r:
        return "-", "-"
    p = r["placed"]
    ratio = r.get("cache_hit_ratio")
    return (f"{p['session']}/{p['prefix']}/{p['spread']}",
            "-" if ratio is None else f"{ratio:.0%}")


def home_waits_cell(r: dict[str, Any] | None) -> str:
    """Requests that waited for their home node, by outcome (home, moved, ...)."""
    waits = (r or {}).get("home_waits") or {}
    return " ".join(f"{k} {v}" for k, v in sorted(waits.items())) or "-"


def load_cell(load: dict[str, Any]) -> str:
    """Per ready model: the predicted wait for a place, busy slots as the engine says them
    (else the hub's in-flight is the only count), requests waiting there for their home."""
    parts = []
    for name, x in sorted(load.items()):
        busy = "" if x.get("busy") is None else f" busy {x['busy']}/{x.get('slots')}"
        home = f" home {x['home_waiting']}" if x.get("home_waiting") else ""
        parts.append(f"{name} wait {x['predicted_wait_ms']:.0f}ms{busy}{home}")
    return ", ".join(parts) or "-"


def models_table(models: list[dict[str, Any]]) -> str:
    rows = [["MODEL", "DESIRED", "READY", "LOADING", "FAILS", "STATE", "NODES",
             "PLACED", "CACHED", "HOME WAITS", "WHY"]]
    for m in models:
        why = m["reason"]
        if m["last_error"] and (m["parked"] or m["consecutive_start_failures"]):
            last = f"last error: {m['last_error']}"
            why = f"{why}; {last}" if why else last
        placed, cached = routing_cell(m.get("routing"))
        rows.append([m["name"], str(m["desired"]), str(m["ready"]), str(m["loading"]),
                     str(m["consecutive_start_failures"]), _model_state(m), ",".join(m["nodes"])
                     or "-", placed, cached, home_waits_cell(m.get("routing")), why or ""])
    return _table(rows)


def nodes_table(nodes: list[dict[str, Any]]) -> str:
    rows = [["NODE", "STATUS", "ENGINES", "MEMORY MiB", "IN-FLIGHT", "READY", "LOAD", "URL"]]
    for n in nodes:
        mem = "-" if n[
            "memory_total_mb"] is None else f"{n['memory_used_mb'] or 0}/{n['memory_total_mb']}"
        engines = ",".join(f"{e['kind']} {e['version']}".strip() for e in n["engines"]) or "-"
        status = n["status"] + (f" ({n['lost_reason']})" if n["status"] == "lost"
                                and n["lost_reason"] else "")
        sick = n.get("unhealthy") or {}
        ready = [f"{m} (UNHEALTHY: {sick[m]})" if m in sick else m for m in n["models"]["ready"]]
        rows.append([n["name"], status, engines, mem, str(n["in_flight"]),
                     ",".join(ready) or "-", load_cell(n.get("load") or {}), n["url"]])
    return _table(rows)


def _num(row: dict[str, Any], key: str, fmt: str = "{:g}") -> str:
    v = row.get(key)
    return "-" if v is None else fmt.format(v)


def slow_table(rows: list[dict[str, Any]]) -> str:
    """`ctl slow`: each slow request's total and where it went -- activation (LOAD),
    admission (QUEUE), the node before its first byte (NODE WAIT), first token (TTFT) --
    then the prompt tokens computed / cached, output tokens and their rate."""
    out = [["TIME", "CLIENT", "MODEL", "NODE", "STATUS", "TOTAL ms", "LOAD", "QUEUE",
            "NODE WAIT", "TTFT", "PREFILL/CACHED", "OUT", "TOK/S", "REQUEST"]]
    for r in rows:
        when = time.strftime("%H:%M:%S", time.localtime(r["ts"])) if r.get("ts") else "-"
        status = f"{r.get('status', '-')}" + (f" {r['error']}" if r.get("error") else "")
        out.append([when, r.get("client") or "-", r.get("model") or "-", r.get("node") or "-",
                    status, _num(r, "ms", "{:.0f}"), _num(r, "load_ms", "{:.0f}"),
                    _num(r, "queue_ms", "{:.0f}"), _num(r, "node_wait_ms", "{:.0f}"),
                    _num(r, "ttfb_ms", "{:.0f}"),
                    f"{_num(r, 'prefill_tokens')}/{_num(r, 'cached_tokens')}",
                    _num(r, "output_tokens"), _num(r, "decode_tps"),
                    r.get("trace_id") or r.get("request_id") or "-"])
    return _table(out)


def _limit(used: int, limit: int | None) -> str:
    return f"{used}" if limit is None else f"{used}/{limit}"


def tenants_table(tenants: dict[str, Any]) -> str:
    """Per key: requests and tokens this minute and today against the limits, in flight,
    queued, tokens served and the share of them."""
    rows = [["CLIENT", "REQ/MIN", "TOK/MIN", "TOK/DAY", "IN-FLIGHT", "QUEUED", "SERVED IN/OUT",
             "SHARE", "WEIGHT", "429s"]]
    for name, t in tenants.items():
        lim = t["limits"]
        rows.append([name, _limit(t["minute"]["requests"], lim["rpm"]),
                     _limit(t["minute"]["tokens"], lim["tpm"]),
                     _limit(t["day_tokens"], lim["tokens_per_day"]),
                     _limit(t["in_flight"], lim["max_concurrent"]), str(t["queued"]),
                     f"{t['served']['input']}/{t['served']['output']}", f"{t['share']:.0%}",
                     f"{lim['weight']:g}", str(t["limited"])])
    return _table(rows)


def cluster_line(c: dict[str, Any]) -> str:
    """Several hubs: who leads, by which epoch, which hubs, and whether etcd answers."""
    leader = f"leader {c['leader']} (epoch {c['epoch']})" if c.get("leader") else "NO LEADER"
    etcd = "etcd up" if c.get("etcd_up") else "etcd UNREACHABLE"
    hubs = ", ".join(c.get("hubs") or [])
    return f"cluster: {leader}; hubs {hubs}; this hub {c.get('name')}; {etcd}"


def render(cmd: str, body: dict[str, Any]) -> str:
    if cmd == "status":
        head = "fleet: satisfied" if body[
            "satisfied"] else f"fleet: NOT SATISFIED ({len(body['problems'])} problems)"
        parts = [head, *(f"  - {p}" for p in body["problems"]), "", models_table(body["models"])
                 if body["models"]
                 else "no models", "", nodes_table(body["nodes"]) if body["nodes"] else "no nodes"]
        if body.get("cluster"):
            parts[1:1] = [cluster_line(body["cluster"])]
        if body.get("tenants"):
            parts += ["", tenants_table(body["tenants"])]
        return "\n".join(parts)
    if cmd == "models":
        return models_table(body["models"]) if body["models"] else "no models"
    if cmd == "nodes":
        return nodes_table(body["nodes"]) if body["nodes"] else "no nodes"
    if cmd == "slow":
        return slow_table(body["requests"]) if body["requests"] else "no requests in the last hour"
    if cmd == "retry":
        return f"{body['model']}: {'unparked, ' if body.get('was_parked') else ''}trying again"
    if cmd == "forget":
        return f"{body['node']}: forgotten"
    return f"{body['node']}: {body['action']} done (status now {body['status']})"


def request(args: argparse.Namespace, client: httpx.Client) -> httpx.Response:
    def q(s: str) -> str:
        return urllib.parse.quote(s, safe="")

    if args.cmd in ("status", "models", "nodes"):
        return client.get(f"/admin/{args.cmd}")
    if args.cmd == "slow":
        return client.get("/api/requests/slow", params={"limit": str(args.limit)})
    if args.cmd == "retry":
        return client.post(f"/admin/models/{q(args.model)}/retry")
    if args.cmd == "forget":
        return client.delete(f"/admin/nodes/{q(args.node)}")
    return client.post(f"/admin/nodes/{q(args.node)}/{args.cmd}")


def admin_key(args: argparse.Namespace, err: TextIO) -> str:
    """--key-file, else --key (with a warning: argv is world-readable), else APPLIANCE_ADMIN_KEY."""
    if args.key_file:
        with open(args.key_file, encoding="utf-8") as fh:
            return fh.read().strip()
    if args.key is not None:
        print(
            "appliance ctl: warning: --key shows the admin key in the process list; use --key-file "
            "or "
              "APPLIANCE_ADMIN_KEY", file=err)
        key: str = args.key
        return key
    return os.environ.get("APPLIANCE_ADMIN_KEY", "")
def _progress(line: dict[str, Any]) -> str:
    node = f"{line['node']}: " if line.get("node") else ""
    total, done = line.get("total"), line.get("completed")
    size = ""
    if total and done is not None:
        size = f" {done * 100 // total}% of {total // (1024 * 1024)} MiB"
    return f"{node}{line.get('status', '')}{size}"


def model_op(args: argparse.Namespace, client: httpx.Client, out: TextIO, err: TextIO) -> int:
    """`ctl pull` (progress lines as they come) and `ctl rm`, through /api/pull and /api/delete."""
    params = {"node": args.node} if args.node else None
    if args.cmd == "rm":
        resp = client.request("DELETE", "/api/delete", params=params, json={"model": args.model})
        body = resp.json() if resp.headers.get("content-type",
                                               "").startswith("application/json") else {}
        if resp.status_code != 200:
            print(
                f"appliance ctl rm: the hub answered {resp.status_code}: "
                f"{body.get('error', resp.text[:300])}", file=err)
            return 1
        print(json.dumps(body) if args.json
              else f"{args.model}: deleted on {', '.join(body.get('deleted', []))}", file=out)
        failed = {n: what for n, what in (body.get("nodes") or {}).items()
                  if what not in ("deleted", "not found")}
        for n, what in failed.items():  # deleted elsewhere; these may still hold the model
            print(f"appliance ctl rm: {n}: {what}", file=err)
        return 1 if failed else 0
    last: dict[str, Any] = {}
    with client.stream("POST", "/api/pull", params=params, json={"model": args.model},
                       timeout=httpx.Timeout(None, connect=5.0)) as resp:
        if resp.status_code != 200:
            resp.read()
            print(f"appliance ctl pull: the hub answered {resp.status_code}: {resp.text[:300]}",
                  file=err)
            return 1
        # Lines split on b"\n" only (appliance/http/lines.py); a progress line is small.
        for raw in iter_lines(resp.iter_bytes(), 1024 * 1024):
            if not raw.strip():
                continue
            last = json.loads(raw)
            print(raw.decode(errors="replace") if args.json
                  else (f"error: {last['node'] + ': ' if last.get('node') else ''}{last['error']}"
                                         if "error" in last else _progress(last)), file=out,
                  flush=True)
    return 0 if last.get("status") == "success" else 1


def run(argv: list[str], client: httpx.Client | None = None, out: TextIO | None = None,
        err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return 0 if e.code == 0 else 2
    own = client is None
    if own:
        try:
            key = admin_key(args, err)
        except OSError as e:
            print(f"appliance ctl: --key-file {args.key_file}: {e.strerror}", file=err)
            return 2
        headers = {"authorization": f"Bearer {key}"} if key else {}
        client = httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=TIMEOUT)
    assert client is not None
    try:
        if args.cmd in ("pull", "rm"):
            return model_op(args, client, out, err)
        if args.cmd == "batches":
            return ctlbatches.run(args.action, args.id, args.json, client, out, err)
        resp = request(args, client)
    except httpx.HTTPError as e:
        print(f"appliance ctl: cannot reach the hub at {args.url}: {type(e).__name__}: {e}",
              file=err)
        return 2
    finally:
        if own:
            client.close()
    try:
        body = resp.json()
    except ValueError:
        body = {"error": resp.text[:300]}
    if resp.status_code != 200:
        msg = body.get("error") if isinstance(body, dict) else body
        if isinstance(msg, dict):
            msg = msg.get("message")
        print(f"appliance ctl {args.cmd}: the hub answered {resp.status_code}: {msg}", file=err)
        return 1
    print(json.dumps(body, indent=2) if args.json else render(args.cmd, body), file=out)
    if args.cmd == "status" and not body.get("satisfied", False):
        return 1
    return 0


def main(argv: list[str]) -> int:
    return run(argv)
