"""The systemd units and env examples: systemd-analyze verify, security exposure, and
the settings an operator relies on; the env examples cover every setting and parse."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import msgspec
import pytest

from appliance import config
from tests.harness import ROOT

UNITS = ("appliance-hub.service", "appliance-node.service")
INSTALLED_BINARY = "/usr/local/bin/appliance"
MAX_HUB_EXPOSURE = 2.5

systemd_analyze = shutil.which("systemd-analyze") or ("/usr/bin/systemd-analyze"
                                                      if Path("/usr/bin/systemd-analyze").exists()
                                                      else None)
needs_systemd = pytest.mark.skipif(systemd_analyze is None,
                                   reason="systemd-analyze missing (make test installs Debian's "
                                          "systemd)")


def local_executable() -> str:
    """An executable that exists here, for ExecStart= (verify checks it is executable)."""
    cand = Path(sys.executable).parent / "appliance"
    return str(cand) if cand.exists() else sys.executable


def units_pointing_at(exe: str, dest: Path) -> list[Path]:
    """Copies of both units whose ExecStart= runs `exe` instead of the installed path."""
    out = []
    for name in UNITS:
        text = (ROOT / "systemd" / name).read_text()
        assert INSTALLED_BINARY in text
        p = dest / name
        p.write_text(text.replace(INSTALLED_BINARY, exe))
        out.append(p)
    return out


def verify(paths: list[Path]) -> str:
    """`systemd-analyze verify` output (stdout and stderr); empty means clean."""
    r = subprocess.run([systemd_analyze, "verify", *map(str, paths)], capture_output=True,
                       text=True,
                       cwd=paths[0].parent, timeout=60)
    return (r.stdout + r.stderr).strip() + ("" if r.returncode == 0 else f"\n(exit {r.returncode})")


def exposure(path: Path) -> float:
    r = subprocess.run([systemd_analyze, "security", "--offline=yes", "--no-pager", str(path)],
                       capture_output=True, text=True, cwd=path.parent, timeout=60)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    return float(m.group(1))


def unit_settings(name: str, section: str = "Service") -> dict[str, list[str]]:
    """[Service] key -> every value it is given, in order (systemd allows repeats)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in (ROOT / "systemd" / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = line.strip("[]")
        elif current == section:
            k, _, v = line.partition("=")
            out.setdefault(k.strip(), []).append(v.strip())
    return out


@needs_systemd
def test_units_verify_clean(tmp_path):
    assert verify(units_pointing_at(local_executable(), tmp_path)) == ""


@needs_systemd
def test_verify_catches_a_bad_value(tmp_path):
    """The check above is worth something: a typo is reported."""
    (hub, _node) = units_pointing_at(local_executable(), tmp_path)
    hub.write_text(hub.read_text().replace("WatchdogSec=20s", "WatchdogSec=twenty"))
    assert "WatchdogSec" in verify([hub]) or "twenty" in verify([hub])


@needs_systemd
def test_hub_exposure_at_most_2_5(tmp_path):
    hub, node = units_pointing_at(local_executable(), tmp_path)
    assert exposure(hub) <= MAX_HUB_EXPOSURE
    # The node gives up some isolation for the GPU; it must stay out of "exposed".
    assert exposure(node) <= 5.0


@pytest.mark.parametrize("name", UNITS)
def test_unit_keeps_the_operator_promises(name):
    s = {k: v[-1] for k, v in unit_settings(name).items()}
    assert s["Type"] == "notify"
    assert s["NotifyAccess"] == "all"  # the onefile bootloader's child notifies
    assert s["Restart"] == "on-failure"
    assert s["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert s["KillMode"] == "mixed"
    assert s["LimitNOFILE"] == "65536"
    assert s["WatchdogSec"]
    assert s["ProtectSystem"] == "strict"
    assert s["PrivateTmp"] == "yes"
    assert s["NoNewPrivileges"] == "yes"
    assert s["CapabilityBoundingSet"] == ""
    assert s["RestrictAddressFamilies"] == "AF_INET AF_INET6 AF_UNIX"
    assert "@system-service" in unit_settings(name)["SystemCallFilter"]
    assert "EnvironmentFile" in s
    role = name.split("-")[1].split(".")[0]
    assert s["ExecStart"] == f"{INSTALLED_BINARY} {role} --env-file /etc/appliance/{role}.env"
    # Onefile extraction happens under the runtime directory, made executable.
    tmp = f"/run/appliance-{role}/tmp"
    assert f"appliance-{role}/tmp" in s["RuntimeDirectory"].split()
    assert f"TMPDIR={tmp}" in " ".join(unit_settings(name)["Environment"])
    assert s["ExecPaths"] == tmp
    # Draining takes Hub__DrainSeconds (30 s by default): systemd must wait longer.
    assert int(s["TimeoutStopSec"].rstrip("s")) > 30


def test_hub_unit_specifics():
    s = {k: v[-1] for k, v in unit_settings("appliance-hub.service").items()}
    assert s["DynamicUser"] == "yes"
    assert s["ProtectHome"] == "yes"
    assert s["MemoryDenyWriteExecute"] == "yes"
    assert s["PrivateDevices"] == "yes"


def test_node_unit_keeps_gpus_reachable():
    s = unit_settings("appliance-node.service")
    assert s["DevicePolicy"] == ["closed"]
    assert "char-nvidia* rw" in s["DeviceAllow"]
    assert "PrivateDevices" not in s


# --- env examples ---------------------------------------------------------------------

EXAMPLES = [ROOT / "systemd" / "hub.env.example", ROOT / "systemd" / "node.env.example"]
SETTING_LINE = re.compile(r"^#\s?((?:APPLIANCE_)?[A-Za-z]+__[A-Za-z0-9_]+=.*)$")


def _strip(tp):
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType) and len(args) == 1:
        return _strip(args[0])
    return tp


def setting_patterns(cls=config.Config, prefix: str = "") -> list[str]:
    """Every leaf variable of the configuration, as a regex (N: an index, NAME: a word)."""
    out = []
    hints = typing.get_type_hints(cls, include_extras=True)
    indexed = getattr(cls, "INDEXED", None)
    for f in msgspec.structs.fields(cls):
        tp = _strip(hints[f.name])
        name = "" if f.name == indexed else f.encode_name + "__"
        here = prefix + name
        origin = typing.get_origin(tp)
        if origin is list and isinstance(_strip(typing.get_args(tp)[0]), type) \
                and issubclass(_strip(typing.get_args(tp)[0]), msgspec.Struct):
            out += setting_patterns(_strip(typing.get_args(tp)[0]), here + r"\d+__")
        elif origin is dict:
            out += setting_patterns(_strip(typing.get_args(tp)[1]), here + r"\w+?__")
        elif isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            out += setting_patterns(tp, here)
        else:
            out.append(here[:-2])
    return out


def example_settings(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        m = SETTING_LINE.match(line)
        if m:
            k, v = m.group(1).split("=", 1)
            out[k] = v
    return out


def test_env_examples_name_every_setting():
    names = [k for p in EXAMPLES for k in example_settings(p)]
    missing = [pat for pat in setting_patterns()
               if not any(re.fullmatch(pat, n, re.IGNORECASE) for n in names)]
    assert not missing, f"add to systemd/*.env.example: {missing}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_env_example_parses_as_shipped_and_uncommented(path, tmp_path):
    # As installed (everything commented out): the defaults.
    assert config.load({}, str(path)) == config.load({}, None)
    # Every example value, uncommented, is valid.
    uncommented = tmp_path / "all.env"
    uncommented.write_text("\n".join(f"{k}={v}" for k, v in example_settings(path).items()) + "\n")
    config.load({}, str(uncommented))


# --- install.sh -----------------------------------------------------------------------

def test_install_sh_stages_files_and_keeps_operator_settings(tmp_path):
    stage = tmp_path / "root"
    exe = tmp_path / "appliance"
    exe.write_text("#!/bin/sh\necho 'appliance 0.1.0 (test)'\n")
    exe.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "DESTDIR": str(stage)}
    def run():
        return subprocess.run([str(ROOT / "packaging" / "install.sh"), str(exe)], env=env,
                              capture_output=True, text=True, timeout=60)

    r = run()
    assert r.returncode == 0, r.stderr
    assert (stage / "usr/local/bin/appliance").stat().st_mode & 0o777 == 0o755
    for unit in UNITS:
        assert (stage / "etc/systemd/system" / unit).read_text() == (
            ROOT / "systemd" / unit).read_text()
    hub_env = stage / "etc/appliance/hub.env"
    assert hub_env.stat().st_mode & 0o777 == 0o640  # it holds keys
    assert (stage / "etc/appliance/node.env.example").exists()
    hub_env.write_text("Hub__Listen=10.0.0.1:8080\n")
    r = run()
    assert r.returncode == 0, r.stderr
    assert hub_env.read_text() == "Hub__Listen=10.0.0.1:8080\n"
    assert "keeping" in r.stdout
