"""The syncer's status endpoint during a real run: the page in headless Chromium lists every
learner and changes while the run goes on, ``/status.json`` says the same (with the pace, an
ETA and each learner's restarts), ``/metrics`` parses as Prometheus text; a kill without the
run secret (or with another) is refused and changes nothing, and the page's kill button with
the secret crashes the learner, which the launcher restarts, saying so in words. A restarted
syncer serves the page at the same address; if another process took that port meanwhile, at
a new one, written to ``RUN/status_url``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from bases import SMALL

from ddiloco.config import load_config
from ddiloco.runtime.processes.launcher import status_port
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
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    # The page replaces its rows every 2 s, so an element found a moment ago can be stale:
    # rows are read in one script (atomic in the page's event loop) and the kill button is
    # found and clicked again until one click lands on a live row.
    rows_now = "return [...document.querySelectorAll('tr.learner')].map(r => r.innerText)"
    text_of = "return document.getElementById(arguments[0]).innerText"
    live = WebDriverWait(driver, 10, ignored_exceptions=[StaleElementReferenceException])
    try:
        for name in ("first", "second"):
            driver.get(url)
            WebDriverWait(driver, 20).until(lambda d: len(d.execute_script(rows_now)) >= 2)
            out[name] = {
                "rows": driver.execute_script(rows_now),
                "head": driver.execute_script(text_of, "head"),
                "cards": driver.execute_script(text_of, "cards"),
            }
            time.sleep(3.0)
        driver.find_element(By.ID, "secret").send_keys(secret)

        def click_kill(d: Any) -> bool:
            row = d.find_elements(By.CSS_SELECTOR, "tr.learner")[1]
            row.find_element(By.CSS_SELECTOR, "button.kill").click()
            return True

        live.until(click_kill)
        out["killed"] = live.until(lambda d: d.execute_script(text_of, "said"))
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
        failed = "error" in page or "being killed" not in page.get("killed", "")
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
    assert "tokens" in second["head"] and "tokens/s" in second["cards"]  # in words
    assert "ETA to the end of the run" in second["cards"] and "eval loss" in second["cards"]
    status = state["status"]
    assert {r["learner"] for r in status[0]["learners"]} <= {0, 1}  # (one may not be in yet)
    assert [r["learner"] for r in status[1]["learners"]] == [0, 1]
    assert status[1]["tokens"] > status[0]["tokens"] and status[1]["rounds"] > status[0]["rounds"]
    assert all(r["last_merged"] for r in status[1]["learners"])
    assert all(0 < r["last_merged"]["share"] <= 1 for r in status[1]["learners"])
    assert [r["restarts"] for r in status[1]["learners"]] == [0, 1]  # the one killed
    pace = status[1]["pace"]
    assert pace["tokens_per_second"] > 0 and pace["eta_seconds"] > 0  # far from 10M tokens
    assert status[1]["progress"] and status[1]["progress"][-1][1] <= status[1]["tokens"]
    families = {f.name: f for f in parser.text_string_to_metric_families(state["metrics"])}
    assert {"ddiloco_tokens", "ddiloco_rounds", "ddiloco_learner_up"} <= set(families)
    assert {"ddiloco_tokens_per_second", "ddiloco_learner_restarts"} <= set(families)
    ups = {s.labels["learner"]: s.value for s in families["ddiloco_learner_up"].samples}
    assert ups == {"0": 1.0, "1": 1.0}
    assert state["post"] == [401, 403, 404]  # no secret, another one, no such action
    # the button, with the secret: accepted (202), and said in words
    assert page["killed"].startswith("learner 1 is being killed"), page
    assert "restarts and copies a healthy peer" in page["killed"]
    (operator,) = [r for r in records if r["kind"] == "operator"]
    assert operator["action"] == "kill" and operator["learner"] == 1
    died = [r for r in records if r["kind"] == "exited" and r.get("code")]
    assert [r["process"] for r in died] == ["learner-1"], died  # only the one it killed
    assert died[0]["t"] > operator["t"]  # ... after the request, not before
    assert status[1]["actions"]["refused_no_secret"] == 1
    assert status[1]["actions"]["refused_bad_secret"] == 1
    assert summary["ledger_balanced"]
    assert (Path(tmp_path) / "status_url").exists()


def test_a_restarted_syncer_serves_the_page_at_the_same_address(tmp_path, monkeypatch):
    """Killed once, the syncer comes back on its page's port (the URL a user opened works);
    killed again while another process holds that port (taken between the launcher's check
    and the syncer's bind: the check is told it is free), it comes back on a free one, whose
    URL replaces the old one in RUN/status_url."""
    config = load_config(None, [*SMALL, "train.tokens=10000000", "processes.max_wall_seconds=150"])
    state: dict[str, Any] = {"rounds": 0, "urls": [], "kills": 0}
    holder: list[socket.socket] = []

    def hook(launcher: Launcher, r: dict[str, Any]) -> None:
        if r["kind"] == "syncer_up":
            state["urls"].append(r["status_url"])
            state["rounds"] = 0
            if len(state["urls"]) == 2:  # the old URL answers: the restarted syncer's page
                state["answered"] = json.loads(get(state["urls"][0] + "status.json"))
        if r["kind"] != "round":
            return
        state["rounds"] += 1
        if state["rounds"] == 4 and state["kills"] == 0:
            state["kills"] = 1
            launcher.crash_syncer(down_seconds=1.0)
        elif state["rounds"] == 4 and state["kills"] == 1:
            state["kills"] = 2
            state["file"] = (tmp_path / "status_url").read_text().strip()
            launcher.crash_syncer(down_seconds=1.0)
            port = int(state["urls"][-1].rsplit(":", 1)[1].strip("/"))
            holder.append(socket.create_server(("127.0.0.1", port)))  # (the syncer's is shut)
            monkeypatch.setattr(status_port, "port_free", lambda host, port: True)
        elif state["rounds"] == 4 and state["kills"] == 2 and "stopped" not in state:
            state["stopped"] = True
            launcher.request_stop()

    records: list[dict[str, Any]] = []
    try:
        summary = Launcher(config, "decoupled", tmp_path, records.append, hooks=[hook]).run()
    finally:
        for s in holder:
            s.close()
    first, again, moved = state["urls"]
    assert again == first and state["file"] == first  # the same address after a restart
    assert "learners" in state["answered"]  # (its first snapshot may not be out yet)
    assert moved != first and moved.startswith("http://127.0.0.1:")  # the port was taken
    assert (tmp_path / "status_url").read_text().strip() == moved
    exits = [r for r in records if r["kind"] == "exited" and r["process"] == "syncer"]
    assert [r["code"] for r in exits] == [78] and exits[0]["restart"]  # at once, not fatal
    assert "cannot bind" in exits[0]["reason"]
    assert summary["restarts"]["syncer"] == 1 and summary["ledger_balanced"]
