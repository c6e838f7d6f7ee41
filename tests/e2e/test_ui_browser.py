"""The hub's page (/ui/), end to end, in a real headless Chromium.

One fleet for the module: a hub with an admin key and two sim nodes; three always-on
models -- one that fits, one whose load always fails (parked after five failed starts),
one larger than any node (unplaceable). The plain HTTP checks (routes, feeds, the admin
key, what the recent-requests feed may carry) run first; then the browser opens /ui/,
gives the admin key, and everything is asserted from the rendered page: both nodes up,
the parked model with its error and count, the unplaceable one with its numbers; a click
on "Retry" (confirmed) takes the model out of parked, audited with the admin as actor; a
node stopped turns lost on the page; forget goes through DELETE /admin/nodes/NAME. Also:
phone width without sideways scrolling, dark under prefers-color-scheme, an accessible
name on every control, and no key prompt on a hub without an admin key. The screenshot
it takes is the README's picture
(set APPLIANCE_UI_SCREENSHOT=docs/ui.png to refresh it).

Debian's `chromium` and `chromium-driver` are installed by `make test` (test-deps).
"""

from __future__ import annotations

import json
import os
import shutil
import threading

import httpx
import pytest

from tests.harness.fleet import Fleet
from tests.harness.procs import wait_until

pytestmark = pytest.mark.e2e

TOKEN, ADMIN = "node-secret", "admin-secret"
KEV = "unknown model architecture: 'kev'"
SIM = {
    "Sim__Models__0__Name": "sim-fit", "Sim__Models__0__SizeMb": "1000",
    # Each failed start takes a second: after a retry the model stays out of parked for
    # five starts and their backoff (about 12 s), long enough for a 2 s poll to show it.
    "Sim__Models__1__Name": "kev-0.5b", "Sim__Models__1__SizeMb": "300",
    "Sim__Models__1__FailLoad": KEV,
    "Sim__Models__1__LoadSeconds": "1",
    "Sim__Models__2__Name": "phi-4", "Sim__Models__2__SizeMb": "100",
}
CATALOG = {
    "Models__0__Name": "sim-fit", "Models__0__Replicas": "1",
    "Models__1__Name": "kev-0.5b", "Models__1__Replicas": "1",
    "Models__2__Name": "phi-4", "Models__2__MemoryMb": "12000", "Models__2__Replicas": "1",
    "Models__RetryBackoffMaxSeconds": "2", "Models__ParkAfterFailures": "5",
    "Priority__Enabled": "true",
}
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("ui"), token=TOKEN, admin=ADMIN)
    try:
        f.start_hub({"Audit__Path": f.audit_path, **CATALOG})
        for name, mb in (("gpu-a", 4000), ("gpu-b", 8000)):
            f.start_node(name, {"Node__MemoryMb": str(mb), "Node__MaxConcurrency": "4", **SIM})
        f.wait(lambda: sorted(f.up()) == ["gpu-a", "gpu-b"], "both nodes up")
        yield f
    finally:
        f.close()


# --- the routes, without a browser ----------------------------------------------------------

def test_browsers_are_sent_to_the_page_and_the_page_is_served(fleet):
    url = fleet.hub.url
    r = httpx.get(url + "/", headers={"accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    assert r.status_code in (302, 303) and r.headers["location"] == "/ui/"
    api_client = httpx.get(url + "/", headers={"accept": "*/*"})
    assert api_client.status_code == 200 and api_client.text == "Ollama is running"
    assert httpx.get(url + "/ui").headers["location"] == "/ui/"
    page = httpx.get(url + "/ui/")  # no key: the page itself holds no data
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="app.js">' in page.text and "http" not in page.text.split(
        "<body>")[1].split("<footer>")[0]
    for name, ctype in (("app.js", "text/javascript"), ("style.css", "text/css")):
        r = httpx.get(f"{url}/ui/{name}")
        assert r.status_code == 200 and r.headers[
            "content-type"].startswith(ctype) and len(r.content) > 1000
    for bad in ("/ui/../app.py", "/ui/%2e%2e/__init__.py", "/ui/nothing.js", "/ui/static/app.js"):
        assert httpx.get(url + bad).status_code == 404, bad
    assert httpx.post(url + "/ui/").status_code == 405


def test_feeds_need_the_admin_key_and_carry_no_secrets(fleet):
    url = fleet.hub.url
    for feed in ("/api/status/history", "/api/requests/recent"):
        r = httpx.get(url + feed)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # A little traffic, with a key and headers that must not come back out.
    for _ in range(3):
        r = httpx.post(url + "/v1/chat/completions", timeout=30,
                       headers={"authorization": "Bearer sk-client-secret", "x-custom": "hush"},
                       json={"model": "sim-fit", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/chat/completions", json={"model": "no-such", "messages": []},
                   timeout=30)
    assert r.status_code == 404
    recent = fleet.admin.get("/api/requests/recent", params={"limit": 3}).json()["requests"]
    assert len(recent) == 3
    assert recent[0]["model"] == "no-such" and recent[0]["status"] == 404  # newest first
    assert [r["model"] for r in recent[1:]] == ["sim-fit", "sim-fit"] and all(r["status"] == 200
                                                                              for r in recent[1:])
    assert recent[1]["priority"] == "normal" and recent[1]["client"] == "anonymous"
    assert recent[1]["node"] in ("gpu-a",
                                 "gpu-b") and recent[
                                     1]["ttfb_ms"] > 0 and recent[1]["ms"] >= recent[1]["ttfb_ms"]
    text = json.dumps(fleet.admin.get("/api/requests/recent", params={"limit": 10_000}).json())
    assert "sk-client-secret" not in text and "hush" not in text and "authorization" not in text.lower()
    assert fleet.admin.get("/api/requests/recent", params={"limit": "x"}).status_code == 200
    hist = fleet.admin.get("/api/status/history").json()
    assert hist["step_seconds"] == 5 and hist["window_seconds"] == 900
    wait_until(lambda: any(p["rps"].get("200")
                           for p in fleet.admin.get("/api/status/history").json()["points"]),
               timeout=20, what="a history point with the 200s")


# --- the page, in Chromium --------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    if not (os.path.exists(CHROMEDRIVER) and os.path.exists(CHROMIUM)):
        pytest.skip(
            "Debian's chromium and chromium-driver are missing (make test-deps installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1700", "--force-color-profile=srgb", "--hide-scrollbars"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, fn, what: str, timeout: float = 30):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    def safe(d):
        try:
            return fn(d)
        except StaleElementReferenceException:  # the page redraws every poll
            return False

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(safe, message=what)


def _trickle(url: str, stop: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=30) as c:
        i = 0
        while not stop.wait(0.25):
            model = "no-such" if i % 7 == 6 else "sim-fit"
            c.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user",
                                                                               "content": "hi"}]})
            i += 1


def _click(driver, css: str) -> None:
    """Click `css`, again if the page redrew it between the find and the click."""
    from selenium.webdriver.common.by import By

    _wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, css).click() or True, f"click {css}")


def _text(driver, css: str) -> str:
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, css)
    return " | ".join(e.text for e in found)


def test_the_page_shows_the_fleet_and_its_actions_work(fleet, browser, tmp_path):
    from selenium.webdriver.common.by import By

    d = browser
    for model, code in (("sim-fit", 200), ("sim-fit", 200), ("no-such", 404)):
        r = httpx.post(fleet.hub.url + "/v1/chat/completions", timeout=30,
                       json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == code, r.text
    # A trickle of traffic until the picture is taken, so its charts have lines.
    stop = threading.Event()
    trickle = threading.Thread(target=_trickle, args=(fleet.hub.url, stop), daemon=True)
    trickle.start()
    wait_until(lambda: fleet.models()["kev-0.5b"]["parked"], timeout=60, what="kev parked")
    d.get(fleet.hub.url + "/")  # a browser's GET / lands on the page
    assert d.current_url.endswith("/ui/")

    # The hub has an admin key: the page asks for it once, then keeps it for the tab.
    _wait(d, lambda d: d.find_element(By.ID, "keyform").is_displayed(), "the admin key form")
    d.find_element(By.ID, "admin-key").send_keys(ADMIN)
    d.find_element(By.ID, "key-save").click()
    assert d.execute_script("return sessionStorage.getItem('appliance.adminKey')") == ADMIN

    # Both nodes up, with what the hub knows of them.
    _wait(d, lambda d: len(d.find_elements(By.CSS_SELECTOR, "article.node[data-status=up]")) == 2,
          "two nodes up")
    for name, total in (("gpu-a", "3.9 GiB"), ("gpu-b", "7.8 GiB")):
        card = _text(d, f"article.node[data-node={name}]")
        assert name in card and "up" in card and "sim" in card and total in card and "of 4" in card, card

    # Loud at the top: the parked model with its error and count, the unplaceable one with its
    # numbers.
    parked = _text(d, "#attention li[data-model='kev-0.5b'][data-state=parked]")
    assert KEV in parked and "parked after 5 failed starts" in parked, parked
    unpl = _text(d, "#attention li[data-model='phi-4'][data-state=unplaceable]")
    assert "needs 12000 MiB" in unpl and "the most free is" in unpl and "MiB on gpu-" in unpl, unpl
    row = _text(d, "#models tr[data-model='kev-0.5b']")
    assert "parked" in row and KEV in row and " 5 " in f" {row} ", row
    _wait(d, lambda d: "sim-fit" in _text(d, "#models tr[data-model='sim-fit'][data-state=ready]"),
          "sim-fit ready")
    # Each ready replica's predicted wait for a place on its node card (hub/decide/cost.py).
    _wait(d, lambda d: "sim-fit (ready, wait ~" in _text(d, "#nodes"), "the predicted wait")
    # How its requests were placed (session / prefix / spread) and the engines' cache share.
    _wait(d, lambda d: " · " in _text(d, "#models tr[data-model='sim-fit'] td.routing")
          and "cached" in _text(d, "#models tr[data-model='sim-fit'] td.routing"), "routing cell")
    # The requests above, in the last-requests table and the requests-per-second chart.
    _wait(d, lambda d: "sim-fit" in _text(d, "#recent tbody")
          and "404" in _text(d, "#recent tbody"), "recent rows")
    _wait(d, lambda d: "200" in _text(d, "#charts"), "the requests chart's legend")
    # Priority is on: the classes and the reserve.
    assert "Reserve: 1 place" in d.find_element(By.ID, "priority").text
    normal = _text(d, "#priority-table tr[data-class=normal]").split()
    assert normal[0] == "normal" and int(normal[-1]) >= 2, normal  # requests: at least the two 200s
    # Each client's use (the anonymous one here: no keys are configured), and tokens per
    # second among the charts.
    anon = _text(d, "#tenants-table tr[data-client=anonymous]")
    assert anon.startswith("anonymous") and " / " in anon, anon
    _wait(d, lambda d: "Tokens per second" in _text(d, "#charts figcaption"), "the tokens chart")

    _wait(d,
          lambda d: len(
              d.execute_script("return document.querySelectorAll('#charts polyline').length ? "
                                            "document.querySelector('#charts "
                                            "polyline').getAttribute('points').split(' ') : []")) >= 3,
          "three points on the requests chart", timeout=30)
    stop.set()
    trickle.join(10)
    shot = tmp_path / "ui.png"
    assert d.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if os.environ.get("APPLIANCE_UI_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["APPLIANCE_UI_SCREENSHOT"])

    # Phone width: one column, nothing wider than the screen.
    d.set_window_size(390, 900)
    assert d.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
    d.set_window_size(1280, 1700)

    # Dark when the system asks for it; every control and chart has an accessible name.
    def background() -> str:
        return d.execute_script("return getComputedStyle(document.body).backgroundColor")

    light = background()
    d.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme",
                                                                   "value": "dark"}]})
    dark = background()
    d.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})
    assert light == "rgb(247, 247, 245)" and dark == "rgb(18, 20, 22)", (light, dark)
    unnamed = d.execute_script("""
        const bad = [];
        for (const b of document.querySelectorAll('button')) if (!(b.getAttribute('aria-label') || b.textContent.trim())) bad.push(b.outerHTML);
        for (const i of document.querySelectorAll('input')) if (!(i.labels && i.labels.length)) bad.push(i.outerHTML);
        for (const g of document.querySelectorAll('svg')) if (!g.getAttribute('aria-label')) bad.push('svg');
        return bad;""")
    assert unnamed == []
    assert "Retry model kev-0.5b" in d.execute_script(
        "return [...document.querySelectorAll('button[data-action=retry]')].map(b => "
        "b.getAttribute('aria-label')).join()")

    # Retry (confirmed) takes the model out of parked; the audit names the admin.
    _click(d, "#attention button[data-action=retry][data-model='kev-0.5b']")
    _wait(d, lambda d: d.switch_to.alert, "the confirm dialog", timeout=30).accept()
    _wait(d, lambda d: not d.find_elements(By.CSS_SELECTOR, "#attention li[data-model='kev-0.5b']")
          and d.find_elements(By.CSS_SELECTOR,
                              "#models tr[data-model='kev-0.5b']:not([data-state=parked])"),
          "kev out of parked", timeout=30)
    assert "Retry model kev-0.5b: done" in d.find_element(By.ID, "notice").text
    admin = [x for x in fleet.audit() if x["kind"] == "admin"]
    assert admin and admin[-1][
        "action"] == "retry" and admin[-1]["actor"] == "admin" and admin[-1]["model"] == "kev-0.5b"

    # Cordon through the page: confirmed, applied, audited.
    _click(d, "button[data-action=cordon][data-node=gpu-b]")
    _wait(d, lambda d: d.switch_to.alert, "the confirm dialog", timeout=30).accept()
    _wait(d, lambda d: d.find_elements(By.CSS_SELECTOR,
                                       "article.node[data-node=gpu-b][data-status=cordoned]"),
          "gpu-b cordoned", timeout=30)
    assert [x["node"] for x in fleet.audit() if x.get("action") == "cordon"] == ["gpu-b"]

    # A node that stops turns lost on the page within a few seconds.
    fleet.node("gpu-a").kill()
    _wait(d, lambda d: d.find_elements(By.CSS_SELECTOR,
                                       "article.node[data-node=gpu-a][data-status=lost]"),
          "gpu-a lost on the page", timeout=30)
    assert "gpu-a" in _text(d, "#attention li[data-state=lost]")

    # Forget the lost node (DELETE /admin/nodes/gpu-a): it leaves the page, or -- on a hub
    # without that route -- the page shows the hub's own refusal, not a silent nothing.
    _click(d, "button[data-action=forget][data-node=gpu-a]")
    _wait(d, lambda d: d.switch_to.alert, "the confirm dialog", timeout=30).accept()
    _wait(d, lambda d: not d.find_elements(By.CSS_SELECTOR, "article.node[data-node=gpu-a]")
          or "Forget node gpu-a failed: " in d.find_element(By.ID, "notice").text,
          "gpu-a forgotten or refused",
          timeout=30)
    if d.find_elements(By.CSS_SELECTOR, "article.node[data-node=gpu-a]"):
        assert "no such admin path" in d.find_element(By.ID, "notice").text
        assert fleet.admin.delete("/admin/nodes/gpu-a").status_code == 404
    else:
        assert "Forget node gpu-a: done" in d.find_element(By.ID, "notice").text
        assert [x["node"] for x in fleet.audit() if x.get("action") == "forget"] == ["gpu-a"]


def test_no_prompt_without_an_admin_key(browser, tmp_path):
    """A hub with no admin key: the page shows the (empty) fleet and never asks for a key."""
    from selenium.webdriver.common.by import By

    fleet = Fleet(token=None)
    try:
        hub = fleet.start_hub(metrics=False)
        browser.get(hub.url + "/ui/")
        _wait(browser, lambda d: "0 of 0 nodes up" in d.find_element(By.ID, "summary").text,
              "the summary")
        assert not browser.find_element(By.ID, "keyform").is_displayed()
        assert "No nodes known yet." in browser.find_element(By.ID, "nodes").text
        assert browser.execute_script("return sessionStorage.length") == 0
    finally:
        fleet.close()
