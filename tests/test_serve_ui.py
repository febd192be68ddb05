"""``serve``'s chat page (``GET /``): its files are package data, ``--no-ui`` turns it
off (``HEAD /`` answers either way), and a real Chromium (Debian's ``chromium`` and
``chromium-driver``, through Selenium) drives it against a running ``serve`` on the tiny
model: the key dialog, streamed replies, stop, regenerate, edit, the live panel and its
plot, a reload, a 429, a lost connection and a restart. Without the browser these tests
skip, saying so; with ``$CI`` set they fail instead. Screenshots (1280x800 and 400x800)
go to ``$MLX_STREAM_UI_SCREENSHOTS`` or a temporary folder."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import re
import shutil
from importlib import resources
from pathlib import Path

import pytest

from tests.support.server import Server
from tests.support.server import http as plain_http

KEY = "page-test-key"
FLAGS = ("--api-key", KEY, "--max-sessions", "1", "--sinks", "2", "--window", "64",
         "--max-tokens", "40")  # fmt: skip
# Injected before the page's own script: while window.__long is set, chat requests ban the
# tiny model's end-of-turn tokens, so a reply runs long enough to be stopped or cut mid-stream.
LONG_REPLIES = """
(() => {
  const real = window.fetch;
  window.fetch = (url, init) => {
    if (window.__long && String(url).endsWith("/v1/chat/completions") && init && init.body) {
      const body = JSON.parse(init.body);
      body.logit_bias = {"1": -100, "2": -100, "3": -100};
      body.max_tokens = 3000;
      init = {...init, body: JSON.stringify(body)};
    }
    return real(url, init);
  };
})();
"""


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (pip install -e '.[test]')"
    missing = [n for n in ("chromium", "chromedriver") if shutil.which(n) is None]
    if missing:
        return (
            f"{' and '.join(missing)} not found: the browser tests need Debian's chromium and "
            "chromium-driver (apt-get install chromium chromium-driver)"
        )
    return None


def need_browser() -> None:
    reason = browser_missing()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(reason)
    pytest.skip(reason)


# --------------------------------------------------------------- the page's files


def test_the_page_files_are_package_data():
    folder = resources.files("mlx_stream.serve").joinpath("ui")
    names = {p.name for p in folder.iterdir()}
    assert {"index.html", "app.js", "style.css"} <= names
    html = folder.joinpath("index.html").read_text()
    # Nothing fetched from anywhere but this server: the page works offline.
    for name in names:
        text = folder.joinpath(name).read_text()
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text), name
    assert '<script src="/ui/app.js"' in html and "<script>" not in html  # no inline script
    # Model output goes into the page as text only.
    assert "innerHTML" not in folder.joinpath("app.js").read_text()


@pytest.fixture(scope="module")
def engine(loaded, tmp_path_factory):
    from mlx_stream.cache import CacheSpec
    from mlx_stream.generate.session import Settings
    from mlx_stream.serve.engine import Engine

    model, tokenizer = loaded
    settings = Settings(CacheSpec(sinks=2, window=64), max_tokens=4)
    e = Engine(model, tokenizer, settings, "tiny", state_dir=tmp_path_factory.mktemp("state"))
    e.start()
    yield e
    e.stop()


def test_get_slash_is_the_page_open_without_a_key_and_no_ui_turns_it_off(engine):
    from fastapi.testclient import TestClient

    from mlx_stream.serve.app import create_app

    with TestClient(create_app(engine, api_keys=["k"], quiet=True)) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert client.get("/ui/app.js").headers["content-type"].startswith("text/javascript")
        assert client.get("/ui/style.css").status_code == 200
        assert client.get("/ui/missing.js").status_code == 401  # not a page file: keyed
        assert client.get("/v1/models").status_code == 401  # the API still needs the key
    for ui in (True, False):
        with TestClient(create_app(engine, quiet=True, ui=ui)) as client:
            assert client.head("/").status_code == 200  # Claude Code's connectivity check
            assert client.get("/").status_code == (200 if ui else 405)  # HEAD only
            assert client.get("/ui/app.js").status_code == (200 if ui else 404)


def test_serve_no_ui_has_no_page_and_says_none(tiny_model_dir):
    s = Server(tiny_model_dir, "--no-ui", "--max-tokens", "4")
    try:
        assert plain_http("HEAD", s.url + "/").status_code == 200
        assert plain_http("GET", s.url + "/").status_code == 405
        assert plain_http("GET", s.url + "/ui/app.js").status_code == 404
        assert "chat page" not in s.log() and f"http://127.0.0.1:{s.port}/v1" in s.log()
    finally:
        s.stop()


# -------------------------------------------------------------- a real browser


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """``{"s": Server}``: the test that restarts it puts the new one in."""
    need_browser()
    holder = {
        "s": Server(tiny_model_dir, *FLAGS, "--state-dir", str(tmp_path_factory.mktemp("st")))
    }
    holder["dir"] = tiny_model_dir
    yield holder
    holder["s"].stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    where = os.environ.get("MLX_STREAM_UI_SCREENSHOTS")
    folder = Path(where) if where else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def driver(server):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,800", "--force-prefers-reduced-motion"):  # fmt: skip
        options.add_argument(arg)
    d = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    d.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": LONG_REPLIES})
    d.get(server["s"].url + "/")
    yield d
    d.quit()


def wait(driver, condition, timeout: float = 20, what: str = ""):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    ignored = (StaleElementReferenceException,)  # the page re-rendered under a read
    return WebDriverWait(driver, timeout, 0.05, ignored_exceptions=ignored).until(
        lambda d: condition(d), message=what
    )


def css(driver, selector):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def viewport(driver, width: int, height: int) -> None:
    """The page's size in CSS pixels, whatever the window's frame takes."""
    metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)


def visible(driver, selector) -> bool:
    return any(e.is_displayed() for e in css(driver, selector))


def type_message(driver, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = css(driver, "#input")[0]
    box.clear()
    box.send_keys(text + Keys.ENTER)


def idle(driver) -> bool:
    return not visible(driver, "#stop") and not css(driver, ".msg.streaming")


def messages(driver) -> list[tuple[str, str]]:
    """(role, text) of the conversation on screen, read at one instant."""
    shown = driver.execute_script(
        """return [...document.querySelectorAll(".msg")].map((m) => [
             m.classList.contains("user") ? "user" : "assistant",
             (m.querySelector(".body") || {innerText: ""}).innerText.trim()]);"""
    )
    return [tuple(m) for m in shown]


def stat(driver, name: str) -> str:
    found = css(driver, f'dd[data-stat="{name}"]')
    return found[0].text if found else ""


def number(text: str) -> int:
    digits = text.replace(",", "")
    assert re.fullmatch(r"\d+", digits), text
    return int(digits)


def session_of(server, driver) -> dict | None:
    """This conversation's session as /v1/sessions reports it."""
    sid = driver.execute_script("return state.conv.session")
    conn = http.client.HTTPConnection("127.0.0.1", server["s"].port, timeout=10)
    conn.request("GET", "/v1/sessions", headers={"Authorization": f"Bearer {KEY}"})
    data = json.loads(conn.getresponse().read())["data"]
    conn.close()
    return next((s for s in data if s["id"] == sid), None)


def test_the_banner_prints_the_page_address(server):
    s = server["s"]
    assert f"chat page http://127.0.0.1:{s.port}/" in s.log()


def test_the_page_asks_for_the_api_key_and_keeps_it_in_the_browser(driver, server):
    wait(driver, lambda d: visible(d, "#key-dialog"), what="no API key dialog")
    css(driver, "#key")[0].send_keys("wrong")
    css(driver, "#key-save")[0].click()
    wait(driver, lambda d: "refused" in css(d, "#key-why")[0].text, what="a bad key not said")
    css(driver, "#key")[0].send_keys(KEY)
    css(driver, "#key-save")[0].click()
    wait(driver, lambda d: not visible(d, "#key-dialog"))
    wait(driver, lambda d: "tiny-llama" in css(d, "#model")[0].text, what="no model picker")
    assert driver.execute_script("return localStorage.getItem('mlx-stream.api-key')") == KEY
    wait(driver, lambda d: "online" in css(d, "#status")[0].text)


def test_a_question_gets_a_streamed_answer_with_settings_and_a_system_prompt(driver, server):
    css(driver, "#show-settings")[0].click()
    css(driver, "#system")[0].send_keys("you are a captain")
    css(driver, "#temperature")[0].send_keys("0")
    css(driver, "#settings-done")[0].click()
    type_message(driver, "hello there")
    wait(driver, lambda d: len(messages(d)) == 2, what="no reply appeared")
    wait(driver, idle, what="the reply never ended")
    (role, question), (_, answer) = messages(driver)
    assert (role, question) == ("user", "hello there") and answer.strip()
    assert driver.execute_script("return state.conv.system") == "you are a captain"
    # the turn's numbers are shown: a system prompt no session had is computed for it
    wait(driver, lambda d: re.fullmatch(r"\d+ \(\d+\)", stat(d, "cached")))
    prompt, cached = map(int, re.findall(r"\d+", stat(driver, "cached")))
    assert cached == 0 < prompt
    assert number(stat(driver, "tokens")) > 0
    assert stat(driver, "ttft").endswith("ms") or stat(driver, "ttft").endswith(" s")
    wait(driver, lambda d: stat(d, "seen") not in ("", "–"), what="panel never updated")
    assert number(stat(driver, "seen")) >= prompt


def test_markdown_is_rendered_and_never_run_as_html(driver):
    made = driver.execute_script(
        """
        const box = document.createElement("div");
        box.append(renderMarkdown(arguments[0]));
        document.body.append(box);
        const out = {img: box.querySelectorAll("img, script").length, html: box.innerHTML,
                     strong: box.querySelector("strong") && box.querySelector("strong").textContent,
                     code: box.querySelector("pre code") && box.querySelector("pre code").textContent,
                     links: [...box.querySelectorAll("a")].map((a) => a.href)};
        box.remove();
        return out;
        """,
        '<img src=x onerror="window.__pwned=1"> **bold** [a](javascript:alert(1)) '
        "[b](https://example.org/x)\n```html\n<script>window.__pwned=2</script>\n```",
    )
    assert made["img"] == 0 and made["strong"] == "bold"
    assert made["code"] == "<script>window.__pwned=2</script>"
    assert made["links"] == ["https://example.org/x"]
    assert "&lt;img" in made["html"]
    assert driver.execute_script("return window.__pwned") is None


def test_stop_ends_a_reply_mid_stream_and_keeps_what_arrived(driver, server):
    driver.execute_script("window.__long = true")
    try:
        type_message(driver, "tell me a long story")
        wait(driver, lambda d: len(messages(d)) == 4 and messages(d)[3][1].strip())
        first = len(messages(driver)[3][1])
        wait(driver, lambda d: len(messages(d)[3][1]) > first, what="the reply did not stream")
        css(driver, "#stop")[0].click()
        wait(driver, idle, what="stop did not end the reply")
    finally:
        driver.execute_script("window.__long = false")
    last = css(driver, ".msg.assistant")[-1]
    assert "stopped" in last.get_attribute("class").split()
    assert "stopped" in last.text and messages(driver)[3][1].strip()
    # the server ended the request too: the session is no longer busy
    wait(driver, lambda d: not session_of(server, d)["busy"], timeout=5)


def test_regenerate_replaces_the_last_reply(driver, server):
    before = messages(driver)
    posts = server["s"].log().count("POST /v1/chat/completions 200")
    css(driver, ".regen-btn")[0].click()
    wait(driver, lambda d: server["s"].log().count("POST /v1/chat/completions 200") > posts)
    wait(driver, idle)
    after = messages(driver)
    assert len(after) == len(before) and after[:3] == before[:3]
    assert "stopped" not in css(driver, ".msg.assistant")[-1].get_attribute("class")
    # the server's session holds one turn per question (a stopped turn was rolled back)
    assert session_of(server, driver)["turns"] == sum(r == "user" for r, _ in after) == 2


def test_edit_resends_from_the_edited_message(driver, server):
    css(driver, ".edit-btn")[1].click()  # the second question
    box = css(driver, ".edit textarea")[0]
    box.clear()
    box.send_keys("<b>not bold</b> and the sea")
    css(driver, ".save-edit")[0].click()
    wait(driver, lambda d: len(messages(d)) == 4 and idle(d))
    wait(driver, idle)
    shown = messages(driver)
    assert shown[2] == ("user", "<b>not bold</b> and the sea")  # text, never markup
    assert shown[3][1].strip() and not css(driver, ".msg.user b")


def test_the_panel_shows_flat_memory_and_the_plot(driver, server, shots):
    for question in ("and then?", "what is the capital of france?"):
        n = len(messages(driver))
        type_message(driver, question)
        wait(driver, lambda d, n=n: len(messages(d)) == n + 2 and idle(d))
    wait(driver, lambda d: len(css(d, "#plot polyline")) == 1, what="no plot")
    wait(driver, lambda d: number(stat(d, "evicted")) > 0, what="nothing evicted yet")
    points = css(driver, "#plot polyline")[0].get_attribute("points").split()
    assert len(points) >= 2
    ys = {p.split(",")[1] for p in points}
    assert len(ys) == 1, points  # device bytes: one flat line however many tokens seen
    assert css(driver, "#plot .window")  # the point where the window filled is marked
    device = session_of(server, driver)["device_bytes"]
    assert stat(driver, "device").endswith(("KB", "MB")) and device > 0
    assert css(driver, "#sessions tr.current"), "this conversation's session not listed"
    assert "budget" in css(driver, "#budget")[0].text
    viewport(driver, 1280, 800)
    driver.save_screenshot(str(shots / "page-1280x800.png"))
    viewport(driver, 400, 800)
    try:
        assert (
            driver.execute_script("return document.body.scrollWidth") <= 400
        )  # no sideways scroll
        assert not visible(driver, "#panel") and visible(driver, "#show-panel")
        driver.save_screenshot(str(shots / "page-400x800.png"))
        css(driver, "#show-panel")[0].click()
        wait(driver, lambda d: visible(d, "#panel"))
        driver.save_screenshot(str(shots / "page-400x800-panel.png"))
        css(driver, "#show-panel")[0].click()
    finally:
        viewport(driver, 1280, 800)
    assert all(
        (shots / n).stat().st_size > 10_000 for n in ("page-1280x800.png", "page-400x800.png")
    )


def test_a_reload_finds_the_conversation(driver):
    before = messages(driver)
    driver.refresh()
    wait(driver, lambda d: messages(d) == before, what="the conversation did not come back")
    assert css(driver, "#conversations li.current")


def test_another_tab_shares_the_conversations(driver):
    first, url = driver.current_window_handle, driver.current_url
    titles = [li.text for li in css(driver, "#conversations li")]
    shown = messages(driver)
    driver.switch_to.new_window("tab")
    try:
        driver.get(url)
        wait(driver, lambda d: [li.text for li in css(d, "#conversations li")] == titles)
        assert messages(driver) == shown  # the most recent conversation opens
        css(driver, "#new-chat")[0].click()
        type_message(driver, "from the second tab")
        wait(driver, lambda d: len(messages(d)) == 2 and idle(d))
    finally:
        driver.close()
        driver.switch_to.window(first)
    # the first tab hears of it (a storage event) and keeps its own conversation open
    wait(driver, lambda d: "from the second tab" in css(d, "#conversations")[0].text)
    assert css(driver, "#conversations li.current")[0].text.startswith("hello there")
    assert messages(driver) == shown


def test_a_429_says_when_to_retry(driver, server):
    s = server["s"]
    # Another client's long reply holds the one session the server may keep (--max-sessions 1)
    hog = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
    body = {"model": "default", "stream": True, "max_tokens": 3000,
            "logit_bias": {"1": -100, "2": -100, "3": -100}, "messages": [{"role": "user", "content": "go"}]}  # fmt: skip
    hog.request("POST", "/v1/chat/completions", json.dumps(body),
                {"Authorization": f"Bearer {KEY}", "X-Session-ID": "hog",
                 "Content-Type": "application/json"})  # fmt: skip
    response = hog.getresponse()
    assert response.status == 200
    response.fp.readline()  # the first event: it runs
    try:
        type_message(driver, "are you there?")
        wait(driver, lambda d: css(d, ".msg.error"), what="no 429 shown")
        text = css(driver, ".msg.error")[0].text
        assert "busy (429)" in text and re.search(r"Retry in \d+ s", text), text
        assert not css(driver, ".retry-btn")[0].is_enabled()
    finally:
        hog.close()  # the server ends that reply at its next token
    wait(driver, lambda d: css(d, ".retry-btn") and css(d, ".retry-btn")[0].is_enabled(),
         what="retry never enabled")  # fmt: skip
    css(driver, ".retry-btn")[0].click()
    wait(driver, lambda d: not css(d, ".msg.error") and idle(d) and messages(d)[-1][1].strip())
    assert messages(driver)[-2] == ("user", "are you there?")


def test_a_lost_connection_keeps_the_reply_and_the_page_reconnects(driver, server):
    s = server["s"]
    driver.execute_script("window.__long = true")
    try:
        type_message(driver, "one more long story")
        n = len(messages(driver))
        wait(driver, lambda d: len(messages(d)) == n and len(messages(d)[-1][1]) > 20)
        s.proc.kill()  # the server dies mid-reply
        s.stop()
        wait(driver, idle, what="the cut reply never ended")
    finally:
        driver.execute_script("window.__long = false")
    last = css(driver, ".msg.assistant")[-1]
    assert "cut" in last.get_attribute("class").split() and "cut" in last.text
    assert len(messages(driver)[-1][1]) > 20  # what arrived is kept
    wait(driver, lambda d: "offline" in css(d, "#status")[0].text, what="no offline status")
    assert "Lost the server" in css(driver, "#notice")[0].text
    server["s"] = Server(server["dir"], *FLAGS, port=s.port)  # the same address again
    wait(driver, lambda d: "Reconnected" in css(d, "#notice")[0].text, timeout=20)
    type_message(driver, "back again?")
    wait(driver, lambda d: messages(d)[-2][1] == "back again?" and idle(d))
    assert messages(driver)[-1][1].strip()
    assert "cut" in css(driver, ".msg.assistant")[-2].get_attribute("class")
