"""The syncer's status endpoint during a real run: the page in headless Chromium lists every
learner and changes while the run goes on, ``/status.json`` says the same, ``/metrics``
parses as Prometheus text, and nothing sent to it changes the run."""

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


def browse(url: str, out: dict[str, Any]) -> None:
    """Load the page twice in headless Chromium, 3 s apart: the learners' rows each time."""
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
    state: dict[str, Any] = {"rounds": 0, "page": {}}

    def hook(launcher: Launcher, r: dict[str, Any]) -> None:
        state["rounds"] += r["kind"] == "round"
        if state["rounds"] == 4 and "url" not in state:
            state["url"] = (tmp_path / "status_url").read_text().strip()
            state["status"] = [json.loads(get(state["url"] + "status.json"))]
            try:
                urllib.request.urlopen(
                    urllib.request.Request(state["url"] + "kill?learner=0", method="POST")
                )
            except urllib.error.HTTPError as exc:
                state["post"] = exc.code
            state["browser"] = threading.Thread(target=browse, args=(state["url"], state["page"]))
            state["browser"].start()
        if "browser" in state and not state["browser"].is_alive() and "stopped" not in state:
            state["status"].append(json.loads(get(state["url"] + "status.json")))
            state["metrics"] = get(state["url"] + "metrics").decode()  # (both learners in)
            state["stopped"] = True
            launcher.request_stop()

    records: list[dict[str, Any]] = []
    summary = Launcher(config, "decoupled", tmp_path, records.append, hooks=[hook]).run()
    assert "url" in state, "the run never reached 4 rounds"
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
    assert state["post"] == 405  # read-only: a request cannot kill a learner
    assert not [r for r in records if r["kind"] == "exited" and r.get("code")]  # nobody died
    assert summary["ledger_balanced"]
    assert (Path(tmp_path) / "status_url").exists()
