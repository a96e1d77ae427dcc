"""``overnight view`` in a real browser: headless Chromium (Debian's chromium and
chromium-driver, driven by Selenium) on the page of a real job's output. The rows appear, the
filters and a row's prompt work, and a row holding markup shows it as text, never runs it."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

from pipelines import load_config, run_job

from conftest import REPO, cli, job_config
from conftest import table_rows as _rows
from conftest import wait_until as _wait

XSS = '<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">'
ROWS = [{"title": XSS if i == 2 else f"Lamp {i}",
         "description": None if i == 5 else "A steel lamp."} for i in range(60)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def page(tiny_model, ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("view")
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    run_job(load_config(job_config(tiny_model, root / "in.jsonl", root / "out")))
    port = _free_port()
    log = open(root / "view.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "view", str(root / "out"),
                             "--port", str(port)], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, (root / "view.log").read_text()
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    yield url, root
    proc.terminate()
    proc.wait(30)


def test_the_rows_of_a_finished_job_appear_and_markup_in_a_row_is_text(page, browser):
    from selenium.webdriver.common.by import By

    url, root = page
    browser.get(url)
    rows = _wait(lambda: len(_rows(browser)) == 50 and _rows(browser))  # the first page
    heads = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#table thead th")]
    assert heads[:2] == ["title", "description"] and "rewritten" in heads
    assert rows[2][0] == XSS  # the row's value, shown as its characters
    assert browser.execute_script("return window.__xss") is None  # and never run
    assert browser.execute_script("return document.scripts.length") == 1  # view.js alone
    assert browser.find_element(By.ID, "rows").text == "60 / 60"
    _wait(lambda: "null_field: 1" in browser.find_element(By.ID, "errors").text)
    assert "complete" in browser.find_element(By.ID, "state").text
    # the counts are the run report's
    report = json.loads((root / "out.report.json").read_text())
    assert browser.find_element(By.ID, "error-count").text == str(report["rows"]["errors"])
    assert browser.find_element(By.ID, "tokens").text == (
        f"{report['tokens']['prompt']['total']:,} in · {report['tokens']['output']['total']:,} out")
    browser.save_screenshot(str(root / "view.png"))
    # the next page: the last ten rows, in the output's order
    browser.find_element(By.ID, "next").click()
    _wait(lambda: browser.find_element(By.ID, "matching").text == "rows 51–60 of 60")
    assert [r[0] for r in _rows(browser)] == [f"Lamp {i}" for i in range(50, 60)]


LAYOUT = """
const lines = el => { const r = document.createRange(); r.selectNodeContents(el);
  return new Set([...r.getClientRects()].map(b => Math.round(b.top))).size; };
const heads = [...document.querySelectorAll('#table thead th')];
return {heads: heads.map(th => th.textContent), widths: heads.map(th => th.offsetWidth),
        kinds: heads.map(th => th.className),
        wrapped: [...document.querySelectorAll('#table td.short, #table th')]
          .filter(el => el.textContent && lines(el) > 1).map(el => el.textContent)};
"""


def test_the_table_gives_the_generated_text_the_room_and_never_breaks_an_id(page, browser):
    """Issue 59: narrow columns broke words mid-word ("pric e", "SKU- 00001") and the
    32-character request_key took the generated text's width. Ids, numbers and headers keep
    to one line, the generated column is the widest, bookkeeping comes last behind a toggle,
    and an error column only where a row on the page has an error."""
    from selenium.webdriver.common.by import By

    url, _ = page
    browser.get(url)
    _wait(lambda: len(_rows(browser)) == 50)
    shown = browser.execute_script(LAYOUT)
    # the row's own columns (its row_id: no id_column here), the text, Lamp 5's error
    assert shown["heads"] == ["title", "description", "row_id", "rewritten", "error_kind",
                              "error"], shown
    assert shown["kinds"][3] == "generated"
    assert max(shown["widths"]) == shown["widths"][3], shown
    assert shown["wrapped"] == [], shown
    parts = re.search(r"· (\d+) (parts?)$", browser.find_element(By.ID, "state").text)
    assert (parts[2] == "part") == (parts[1] == "1"), parts  # never "1 parts"
    # the toggle: the bookkeeping columns, after the row's own, each on one line
    browser.find_element(By.ID, "bookkeeping").click()
    shown = browser.execute_script(LAYOUT)
    assert shown["heads"][:4] == ["title", "description", "row_id", "rewritten"], shown
    assert {"request_key", "finish_reason", "prompt_tokens", "completion_tokens"} \
        <= set(shown["heads"][4:]), shown
    assert max(shown["widths"]) == shown["widths"][3], shown
    assert shown["wrapped"] == [], shown
    browser.save_screenshot(str(page[1] / "view-bookkeeping.png"))
    # a page with no error on it has no error columns at all
    browser.find_element(By.ID, "bookkeeping").click()
    browser.find_element(By.ID, "next").click()
    _wait(lambda: browser.find_element(By.ID, "matching").text == "rows 51–60 of 60")
    assert "error" not in browser.execute_script(LAYOUT)["heads"]


def test_filters_and_a_rows_prompt(page, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    url, _ = page
    browser.get(url)
    _wait(lambda: len(_rows(browser)) == 50)
    Select(browser.find_element(By.ID, "f-error")).select_by_value("null_field")
    browser.find_element(By.CSS_SELECTOR, "#filters button[type=submit]").click()
    only = _wait(lambda: len(_rows(browser)) == 1 and _rows(browser))
    assert only[0][0] == "Lamp 5"
    Select(browser.find_element(By.ID, "f-error")).select_by_value("")
    where = browser.find_element(By.NAME, "where")
    where.clear()
    where.send_keys("title = 'Lamp 1' OR title LIKE 'Lamp 1_' AND completion_tokens < 0")
    browser.find_element(By.CSS_SELECTOR, "#filters button[type=submit]").click()
    # (the page shows the filter's rows once they come: one row, Lamp 1, of 1 matching)
    _wait(lambda: [r[0] for r in _rows(browser)] == ["Lamp 1"]
          and browser.find_element(By.ID, "matching").text == "rows 1–1 of 1")
    browser.find_element(By.CSS_SELECTOR, "#table tbody tr").click()
    prompt = _wait(lambda: browser.find_element(By.ID, "prompt").text)
    assert "Title: Lamp 1\nA steel lamp." in prompt and "Be brief." in prompt
    # a condition polars cannot parse is one line on the page, not a broken table
    where.clear()
    where.send_keys("title LIKE ((")
    browser.find_element(By.CSS_SELECTOR, "#filters button[type=submit]").click()
    error = _wait(lambda: browser.find_element(By.ID, "rows-error").text)
    assert error.startswith("where 'title LIKE ((': ")


def test_the_page_loads_nothing_from_elsewhere_and_binds_to_loopback(page):
    url, _ = page
    html = httpx.get(url).text
    assert "http://" not in html and "https://" not in html
    headers = httpx.get(url + "api/status").headers
    assert headers["content-security-policy"].startswith("default-src 'self'")
    status = httpx.get(url + "api/status").json()
    assert status["rows_done"] == 60 and status["errors"] == {"null_field": 1}
    assert url.startswith("http://127.0.0.1:")


def test_the_page_of_a_running_job_follows_its_parts(tiny_model, browser, ray_cluster,
                                                    tmp_path):
    """A job run by the CLI while the page is open: the rows written move as parts are
    committed, and the page ends at the whole table, complete."""
    import threading

    import yaml
    from selenium.webdriver.common.by import By

    rows = [{"title": f"Lamp {i}", "description": "A steel lamp."} for i in range(1200)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_config(tiny_model, tmp_path / "in.jsonl",
                                              tmp_path / "out", sampling={"max_tokens": 32})))
    codes = []  # the CLI in this process (its Ray), in a thread while this one reads the page
    job = threading.Thread(target=lambda: codes.append(cli("run", path, "--quiet")[0]))
    job.start()
    record = tmp_path / "out.overnight.json"
    view = None
    try:
        _wait(lambda: record.exists() or not job.is_alive(), timeout=120)
        port = _free_port()
        view = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "view",
                                 str(tmp_path / "out"), "--port", str(port)], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}/"
        _wait(lambda: _up(url), timeout=60)
        browser.get(url)
        seen = []
        while job.is_alive():
            seen.append((browser.find_element(By.ID, "rows").text,
                         browser.find_element(By.ID, "state").text.split(" ")[0]))
            time.sleep(0.5)
        assert codes == [0]
        _wait(lambda: browser.find_element(By.ID, "rows").text == "1,200 / 1,200"
              and browser.find_element(By.ID, "state").text.startswith("complete"), timeout=30)
    finally:
        job.join()
        if view is not None:
            view.terminate()
            view.wait(30)
    running = {text for text, state in seen if state == "running"}
    assert len(running) >= 2, seen  # the page moved while the job ran
    assert any(text not in ("", "-", "0 / 1,200", "1,200 / 1,200") for text in running), seen


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
