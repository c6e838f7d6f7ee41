"""The `appliance` command: hub, node, up, sim, ctl, --version.

Theory of operation: parse argv, read the configuration once (env file, then the process
environment), and hand a typed Config to the role's `main`. A configuration error is one
line on stderr and exit code 2, before anything starts. `ctl` takes no Config: it talks
to a hub named by APPLIANCE_HUB_URL.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from appliance import __version__
from appliance.config import ConfigError, load


def version_string() -> str:
    try:
        from appliance._build import COMMIT  # written by packaging/build.sh
    except ImportError:
        COMMIT = "source"
    return f"appliance {__version__} ({COMMIT})"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="appliance",
                                description="A handful of GPU boxes as one LLM endpoint.")
    p.add_argument("--version", action="store_true",
                   help="print the version and the build's commit")
    sub = p.add_subparsers(dest="cmd")
    for role, text in (
        ("hub", "route clients to nodes"),
        ("node", "run beside an engine on a GPU box"),
        ("up", "a hub and one local node in one process (Ollama if it answers, else sim)"),
        ("sim", "the simulated engine alone on a port (Sim__Listen)"),
    ):
        sp = sub.add_parser(role, help=text)
        sp.add_argument("--env-file", default=os.environ.get("APPLIANCE_ENV_FILE"),
                        help="KEY=VALUE file, read at start and on SIGHUP")
        sp.add_argument("--log-level", default=os.environ.get("APPLIANCE_LOG_LEVEL", "INFO"))
    sub.add_parser("ctl", help="operate a running hub (status, models, nodes, retry, cordon, ...)",
                   add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "ctl":
        from appliance.ctl import main as ctl_main

        return ctl_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.version:
        print(version_string())
        return 0
    if not args.cmd:
        _parser().print_help()
        return 2
    try:
        cfg = load(env_file=args.env_file)
    except ConfigError as e:
        print(f"appliance {args.cmd}: configuration error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # httpx logs every request at INFO: one line per proxied request is noise (and CPU).
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.cmd == "hub":
        from appliance.hub.run import main as role_main
    elif args.cmd == "node":
        from appliance.node.run import main as role_main
    elif args.cmd == "sim":
        from appliance.sim.server import main as role_main
    else:
        from appliance.up import main as role_main
    try:
        return role_main(cfg, env_file=args.env_file)
    except BaseException as e:
        startup = _startup_error(e)
        if startup is None:
            raise
        print(f"appliance {args.cmd}: cannot start: {startup}", file=sys.stderr)
        return 2


def _startup_error(e: BaseException) -> BaseException | None:
    """The StartupError inside `e` (trio wraps it in exception groups), else None."""
    from appliance.server.serve import StartupError

    if isinstance(e, StartupError):
        return e
    if isinstance(e, BaseExceptionGroup):
        for sub in e.exceptions:
            found = _startup_error(sub)
            if found is not None:
                return found
    return None


if __name__ == "__main__":
    sys.exit(main())
