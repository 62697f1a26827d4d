"""The syncer's status endpoint during a real run: the page in headless Chromium lists every
learner and changes while the run goes on, ``/status.json`` says the same, ``/metrics``
parses as Prometheus text; a kill without the run secret (or with another) is refused and
changes nothing, and the page's kill button with the secret crashes the learner, which
the launcher restarts."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from bases import SMALL

from ddiloco.config import load_config
from ddiloco.runtime.processes.launcher.fragments import Launcher

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return bytes(reply.read())


def post(url: str, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST", headers=headers)):
            return 202
    except urllib.error.HTTPError as exc:
        return exc.code


def browse(url: str, out: dict[str, Any], secret: str) -> None:
    """Load the page twice in headless Chromium, 3 s apart (the learners' rows each time),
    then kill learner 1 with its button and the run secret."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        for name in ("first", "second"):
            driver.get(url)
            WebDriverWait(driver, 20).until(
                lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr.learner")) >= 2
            )
            rows = driver.find_elements(By.CSS_SELECTOR, "tr.learner")
            out[name] = {
                "rows": [r.text for r in rows],
                "head": driver.find_element(By.ID, "head").text,
            }
            time.sleep(3.0)
        driver.find_element(By.ID, "secret").send_keys(secret)
        row = driver.find_elements(By.CSS_SELECTOR, "tr.learner")[1]
        row.find_element(By.CSS_SELECTOR, "button.kill").click()
        said = driver.find_element(By.ID, "said")
        WebDriverWait(driver, 10).until(lambda d: said.text)
        out["killed"] = said.text
    except Exception as exc:  # (reported by the test, with the page's state)
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        driver.quit()


def test_the_status_page_shows_every_learner_and_changes_as_the_run_goes_on(tmp_path):
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no chromium / chromedriver (Debian: apt-get install chromium chromium-driver)")
    pytest.importorskip("selenium", reason="the page test drives Chromium with selenium")
    parser = pytest.importorskip("prometheus_client.parser", reason="pip install prometheus-client")
    os.environ.setdefault("SE_OFFLINE", "true")  # (selenium must not look for drivers online)
    config = load_config(None, [*SMALL, "train.tokens=10000000", "processes.max_wall_seconds=150"])
    secret_file = tmp_path / "processes" / "run.secret"  # (written by the launcher, mode 600)
    secret = ""
    state: dict[str, Any] = {"rounds": 0, "page": {}}

    def hook(launcher: Launcher, r: dict[str, Any]) -> None:
        state["rounds"] += r["kind"] == "round"
        nonlocal secret
        if state["rounds"] == 8 and "url" not in state:
            secret = secret_file.read_text().strip()
            assert secret_file.stat().st_mode & 0o777 == 0o600
            state["url"] = (tmp_path / "status_url").read_text().strip()
            state["status"] = [json.loads(get(state["url"] + "status.json"))]
            kill = state["url"] + "learners/0/kill"
            state["post"] = [post(kill, None), post(kill, "00" * 32), post(kill + "x", secret)]
            state["browser"] = threading.Thread(
                target=browse, args=(state["url"], state["page"], secret)
            )
            state["browser"].start()
        restarted = launcher.restarts.get("learner-1")  # (the launcher's own records
        if r["kind"] == "joined" and r["learner"] == 1 and restarted:  # the syncer let it in
            state.setdefault("back", (state["rounds"], time.monotonic()))  # (do not pass
        back = state.get("back")  # through the hooks) ... and a few rounds and beats later
        in_again = back is not None and state["rounds"] >= back[0] + 4
        page = state["page"]
        done = "browser" in state and not state["browser"].is_alive()
        failed = "error" in page or not page.get("killed", "").startswith("202")
        done = done and (failed or (in_again and time.monotonic() - back[1] >= 3.0))
        if done and "stopped" not in state:
            state["status"].append(json.loads(get(state["url"] + "status.json")))
            state["metrics"] = get(state["url"] + "metrics").decode()  # (both learners in)
            state["stopped"] = True
            launcher.request_stop()

    records: list[dict[str, Any]] = []
    summary = Launcher(config, "decoupled", tmp_path, records.append, hooks=[hook]).run()
    assert "url" in state, "the run never reached 8 rounds"
    assert state["url"].startswith("http://127.0.0.1:")
    up = next(r for r in records if r["kind"] == "syncer_up")
    assert up["status_url"] == state["url"]  # the URL is in the metrics too
    page = state["page"]
    assert "error" not in page, page
    first, second = page["first"], page["second"]
    for load in (first, second):  # every learner, with its state
        assert [row.split()[:2] for row in load["rows"]] == [["0", "up"], ["1", "up"]], load
    assert first != second  # it updates as the run goes on (steps, tokens, t)
    status = state["status"]
    assert {r["learner"] for r in status[0]["learners"]} <= {0, 1}  # (one may not be in yet)
    assert [r["learner"] for r in status[1]["learners"]] == [0, 1]
    assert status[1]["tokens"] > status[0]["tokens"] and status[1]["rounds"] > status[0]["rounds"]
    assert all(r["last_merged"] for r in status[1]["learners"])
    families = {f.name: f for f in parser.text_string_to_metric_families(state["metrics"])}
    assert {"ddiloco_tokens", "ddiloco_rounds", "ddiloco_learner_up"} <= set(families)
    ups = {s.labels["learner"]: s.value for s in families["ddiloco_learner_up"].samples}
    assert ups == {"0": 1.0, "1": 1.0}
    assert state["post"] == [401, 403, 404]  # no secret, another one, no such action
    assert page["killed"].startswith("202"), page  # the button, with the secret
    (operator,) = [r for r in records if r["kind"] == "operator"]
    assert operator["action"] == "kill" and operator["learner"] == 1
    died = [r for r in records if r["kind"] == "exited" and r.get("code")]
    assert [r["process"] for r in died] == ["learner-1"], died  # only the one it killed
    assert died[0]["t"] > operator["t"]  # ... after the request, not before
    assert status[1]["actions"]["refused_no_secret"] == 1
    assert status[1]["actions"]["refused_bad_secret"] == 1
    assert summary["ledger_balanced"]
    assert (Path(tmp_path) / "status_url").exists()
