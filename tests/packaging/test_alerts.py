"""packaging/prometheus/alerts.yml: valid, tested by promtool, and about series we publish."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

from tests.harness import ROOT

RULES = ROOT / "packaging" / "prometheus"
PROMTOOL = shutil.which("promtool")

needs_promtool = pytest.mark.skipif(PROMTOOL is None,
                                    reason="promtool missing (make test installs Debian's "
                                           "prometheus)")


def promtool(*args: str, cwd: pathlib.Path = RULES) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_check_rules():
    r = promtool("check", "rules", "alerts.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@needs_promtool
def test_rule_tests_pass():
    r = promtool("test", "rules", "alerts_test.yml")
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_rule_tests_bite(tmp_path):
    """Without the parked alert, or with a not-ready alert that needs a ready replica's series
    to exist at 1 (the bug that made it unable to fire), the tests fail."""
    text = (RULES / "alerts.yml").read_text()
    (tmp_path / "alerts_test.yml").write_text((RULES / "alerts_test.yml").read_text())
    broken = text.replace("expr: appliance_model_desired > 0 and appliance_model_ready == 0",
                          "expr: appliance_model_desired > 0 unless appliance_model_ready")
    assert broken != text
    (tmp_path / "alerts.yml").write_text(broken)
    assert promtool("test", "rules", "alerts_test.yml", cwd=tmp_path).returncode != 0
    without = re.sub(
        r"      - alert: ApplianceModelParked\n(?:        .*\n|\n)*?(?=      - alert:)", "", text)
    assert "ApplianceModelParked" not in without
    (tmp_path / "alerts.yml").write_text(without)
    assert promtool("test", "rules", "alerts_test.yml", cwd=tmp_path).returncode != 0
    never = text.replace("increase(appliance_audit_write_errors_total[5m]) > 0",
                         "appliance_audit_write_errors_total > 100")
    assert never != text
    (tmp_path / "alerts.yml").write_text(never)
    assert promtool("test", "rules", "alerts_test.yml", cwd=tmp_path).returncode != 0


def test_every_alert_is_tested_and_every_failure_mode_has_one():
    alerts = re.findall(r"- alert: (\w+)", (RULES / "alerts.yml").read_text())
    tested = set(re.findall(r"alertname: (\w+)", (RULES / "alerts_test.yml").read_text()))
    assert set(alerts) <= tested, set(alerts) - tested
    for mode in ("ModelNotReady", "ModelParked", "ModelUnplaceable", "ModelStartFailures",
                 "NodeDown",
                 "CertificateExpiring", "NoLeader", "LeaderFlapping", "AuditWriteFailing",
                 "ReplicaUnhealthy"):
        assert f"Appliance{mode}" in alerts


def test_alerts_use_series_the_hub_publishes():
    exprs = re.findall(r"expr: (.*)", (RULES / "alerts.yml").read_text())
    used = {n for e in exprs for n in re.findall(r"\bappliance_[a-z_]+", e)}
    assert "appliance_model_ready" in used and "appliance_node_lost" in used
    source = "".join(p.read_text() for d in ("hub", "cluster")
                     for p in (ROOT / "appliance" / d).rglob("*.py"))
    for name in used:
        assert f'"{name}"' in source, f"{name} is in alerts.yml but no hub module publishes it"
