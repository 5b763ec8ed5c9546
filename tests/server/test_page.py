"""The pages, in a real headless browser: `GET /` (static/index.html: the chat and its live cell
map) against a live server on the tiny preset, and static/trace.html (`kvlayout run --trace`)
with frames put in its placeholder.

Chromium and its driver come from Debian (`apt-get install chromium chromium-driver`), selenium
from the `test` extra. Without them these tests fail, naming the install; they never skip. Every
wait is bounded; every test starts and quits its own browser.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import kvlayout.server
from kvlayout.server.monitor import page as assembled
from tests.server.conftest import Live, serving
from tests.server.test_monitor import SlowModel

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
WAIT_S = 30  # the longest any wait here may take
STATIC = Path(kvlayout.server.__file__).parent / "static"
PLACEHOLDER = "/*KVLAYOUT_FRAMES*/null"
ONE_CELL_PER_BUCKET = {"cache": {"capacity": 2048}}  # at most 4096 buckets: a bucket is a cell
FREE_RGB = (0xE2, 0xE2, 0xE7)  # the page's color for a free bucket
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def driver():
    """A headless Chromium (Debian's, through Debian's chromedriver), quit at the end of the test."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(p)]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not found: the page tests need Debian's headless Chromium; "
                    "run `apt-get install chromium chromium-driver`", pytrace=False)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium is not installed: pip install -e '.[test]' (it is in the test extra)", pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900",
                "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    browser.set_page_load_timeout(WAIT_S)
    browser.set_script_timeout(WAIT_S)
    try:
        yield browser
    finally:
        browser.quit()


@pytest.fixture
def artifacts(tmp_path) -> Path:
    out = Path(os.environ.get("KVLAYOUT_TEST_ARTIFACTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


# -- helpers


def wait_for(driver, what: str, condition: Callable, timeout: float = WAIT_S):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: condition(d))
    except TimeoutException:
        raise AssertionError(f"waited {timeout}s for {what}; the page's map: {map_state(driver, brief=True)}") from None


def by_testid(driver, name: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, f'[data-testid="{name}"]')


def all_by_testid(driver, name: str) -> list:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, f'[data-testid="{name}"]')


def map_state(driver, brief: bool = False) -> dict | None:
    state = driver.execute_script("return window.kvlayoutMap || null")
    if brief and state and state.get("lastFrame"):
        state = {**state, "lastFrame": {k: v for k, v in state["lastFrame"].items() if k != "classes"}}
    return state


def console_problems(driver) -> list[dict]:
    """The browser console's errors and warnings since the last call (the log is drained)."""
    return [e for e in driver.get_log("browser") if e.get("level") in ("SEVERE", "WARNING")]


@contextlib.contextmanager
def opened(driver, live: Live) -> Iterator:
    """The page at `/`, its first frame drawn; closed (its /cells stream with it) before the server stops."""
    driver.get(f"{live.url}/")
    try:
        wait_for(driver, "the first frame of /cells to be drawn", lambda d: (map_state(d) or {}).get("frames", 0) >= 1)
        yield driver
    finally:
        driver.get("about:blank")


def chat(driver, text: str, submit) -> str:
    """Type `text`, send it (`submit(driver)`), wait for the new assistant bubble to finish; its text."""
    before = len(all_by_testid(driver, "assistant-message"))
    by_testid(driver, "chat-input").send_keys(text)
    submit(driver)
    wait_for(driver, "a new assistant bubble", lambda d: len(all_by_testid(d, "assistant-message")) > before)
    bubble = all_by_testid(driver, "assistant-message")[before]
    wait_for(
        driver, "the answer to finish streaming", lambda d: bubble.get_attribute("data-state") in ("done", "error")
    )
    content = driver.execute_script("return arguments[0].textContent", bubble)
    assert bubble.get_attribute("data-state") == "done", f"the page showed an error: {content!r}"
    return content


def click_send(driver) -> None:
    by_testid(driver, "chat-send").click()


def press_enter(driver) -> None:
    from selenium.webdriver.common.keys import Keys

    by_testid(driver, "chat-input").send_keys(Keys.ENTER)


def whole_answer(live: Live, messages: list[dict]) -> str:
    status, body, _ = live.post("/v1/chat/completions", {"model": live.model, "messages": messages,
                                                         "temperature": 0, "max_tokens": 128})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def drawn_non_free(driver) -> int:
    """Buckets whose square, read back from the canvas's pixels, is not the free color."""
    return driver.execute_script("""
        const c = document.querySelector('[data-testid="cell-map"]'), f = window.kvlayoutMap.lastFrame;
        const copy = document.createElement("canvas");  // read back from a copy: the page's context stays unread
        copy.width = c.width; copy.height = c.height;
        const ctx = copy.getContext("2d", {willReadFrequently: true});
        ctx.drawImage(c, 0, 0);
        const {cols, size} = window.kvlayoutMap, px = ctx.getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < f.buckets; i++) {
            const x = Math.floor((i % cols) * size + size / 3), y = Math.floor(Math.floor(i / cols) * size + size / 3);
            const o = (y * c.width + x) * 4;
            if (px[o] !== arguments[0][0] || px[o + 1] !== arguments[0][1] || px[o + 2] !== arguments[0][2]) n++;
        }
        return n;""", list(FREE_RGB))


def settled(driver, live: Live) -> dict:
    """/stats once the page has drawn the frame of its last step (the engine is idle). The live count is
    compared too: the samples a last step's tokens drawn ahead ended are settled after it, a frame later
    at the same step and, their cells kept as prefixes, the same used count."""
    seen: dict = {}

    def caught_up(d) -> bool:
        status, seen["stats"] = live.get("/stats")
        assert status == 200, seen["stats"]
        frame = (map_state(d) or {}).get("lastFrame") or {}
        cells = seen["stats"]["cells"]
        return (frame.get("step") == seen["stats"]["steps"] and frame.get("used") == cells["used"]
                and len(frame.get("live", ())) == cells["live_sequences"])

    wait_for(driver, "the map to show /stats' step", caught_up)
    return seen["stats"]


def hover_bucket(driver, index: int) -> None:
    """Move the mouse onto the center of bucket `index` of the map."""
    from selenium.webdriver.common.action_chains import ActionChains

    canvas = by_testid(driver, "cell-map")
    # The script's two long lines are split in the Python source only: the page gets them whole.
    dx, dy = driver.execute_script("""
        const c = arguments[0], r = c.getBoundingClientRect(), {cols, size} = window.kvlayoutMap,"""
        """ scale = r.width / c.width;
        const x = ((arguments[1] % cols) + 0.5) * size * scale,"""
        """ y = (Math.floor(arguments[1] / cols) + 0.5) * size * scale;
        return [x - r.width / 2, y - r.height / 2];""", canvas, index)
    ActionChains(driver).move_to_element_with_offset(canvas, int(dx), int(dy)).perform()


def classes_of(frame: dict) -> bytes:
    return base64.b64decode(frame["classes"])


def stats_line(frame: dict) -> str:
    return (f"used {frame['used']} of {frame['capacity']} cells · {len(frame['live'])} live sequences · "
            f"cached {frame['cached']} · held once for several owners {frame['shared']}"
            + (f" ({frame['shared_live']} by live sequences)" if "shared_live" in frame else "")
            + f" · step {frame['step']}")


# -- the live page


def test_page_loads_without_console_errors(driver, tiny_loaded):
    with serving(tiny_loaded, ONE_CELL_PER_BUCKET) as live:
        conn = live.connection()
        try:
            conn.request("GET", "/")
            resp = conn.getresponse()
            assert resp.status == 200 and resp.getheader("content-type", "").startswith("text/html")
            assert resp.read().decode() == assembled("index.html")
        finally:
            conn.close()
        with opened(driver, live):
            wait_for(driver, "the model id from /v1/models", lambda d: d.find_element("id", "model").text == live.model)
            for name in ("chat-input", "chat-send", "cell-map", "cell-stats"):
                assert by_testid(driver, name).is_displayed(), name
            frame = map_state(driver)["lastFrame"]
            assert frame["buckets"] == 2048 and frame["bucket"] == 1 and frame["capacity"] == 2048
            assert by_testid(driver, "cell-stats").text == stats_line(frame)
            time.sleep(0.5)  # anything the page logs just after its first frame
            assert console_problems(driver) == []


def test_chat_streams_what_the_whole_answer_says(driver, tiny_loaded):
    from selenium.webdriver.common.keys import Keys

    question = "Tell me about key-value caches in one paragraph."
    with serving(tiny_loaded, ONE_CELL_PER_BUCKET) as live, opened(driver, live):
        box = by_testid(driver, "chat-input")
        box.send_keys("two", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "lines")  # Shift+Enter: a new line, not a send
        assert box.get_attribute("value") == "two\nlines" and all_by_testid(driver, "assistant-message") == []
        box.clear()
        first = chat(driver, question, click_send)
        assert first, "the streamed answer is empty"
        assert first == whole_answer(live, [{"role": "user", "content": question}])
        # Enter sends too, and the page sends the whole conversation so far.
        follow_up = "And in one sentence?"
        second = chat(driver, follow_up, press_enter)
        conversation = [{"role": "user", "content": question}, {"role": "assistant", "content": first},
                        {"role": "user", "content": follow_up}]
        assert second == whole_answer(live, conversation)
        assert console_problems(driver) == []


def test_a_refused_request_shows_the_servers_message(driver, tiny_loaded):
    question = "Hello?"
    with serving(tiny_loaded, {**ONE_CELL_PER_BUCKET, "server": {"max_tokens": 64}}) as live, opened(driver, live):
        status, body, _ = live.post("/v1/chat/completions", {"model": live.model, "stream": True, "temperature": 0,
                                                             "max_tokens": 128,
                                                             "messages": [{"role": "user", "content": question}]})
        assert status == 400, body  # the page asks for 128 tokens; this server gives at most 64
        by_testid(driver, "chat-input").send_keys(question)
        click_send(driver)
        wait_for(driver, "an assistant bubble", lambda d: all_by_testid(d, "assistant-message"))
        bubble = all_by_testid(driver, "assistant-message")[0]
        wait_for(driver, "the bubble to show the error", lambda d: bubble.get_attribute("data-state") == "error")
        assert bubble.text == f"error: {body['error']['message']}"
        problems = console_problems(driver)  # the browser logs the 400 itself, and nothing else
        assert [p["message"] for p in problems if "status of 400" not in p["message"]] == [], problems
        # The failed turn is not part of the conversation: the next request sends its message alone.
        driver.execute_script("""window.sent = []; const fetch0 = window.fetch;
            window.fetch = (url, init) => { if (init && init.body) window.sent.push(JSON.parse(init.body));
                                            return fetch0(url, init); };""")
        by_testid(driver, "chat-input").send_keys("again")
        click_send(driver)
        wait_for(driver, "a second bubble", lambda d: len(all_by_testid(d, "assistant-message")) == 2)
        second = all_by_testid(driver, "assistant-message")[1]
        wait_for(driver, "the second error", lambda d: second.get_attribute("data-state") == "error")
        sent = driver.execute_script("return window.sent")
        assert [b["messages"] for b in sent] == [[{"role": "user", "content": "again"}]], sent
        assert {k: v for k, v in sent[0].items() if k != "messages"} == {
            "model": live.model, "stream": True, "temperature": 0, "max_tokens": 128}


def test_map_draws_the_occupancy_stats_reports(driver, tiny_loaded):
    with serving(tiny_loaded, ONE_CELL_PER_BUCKET) as live, opened(driver, live):
        assert chat(driver, "Describe the cell map of a paged KV cache.", click_send)
        stats = settled(driver, live)
        state = map_state(driver)
        used = stats["cells"]["used"]
        assert used > 0, stats  # the prompt and the answer stay in the prefix cache
        assert state["drawnOccupied"] == used, (state["drawnOccupied"], stats)
        assert drawn_non_free(driver) == used  # the canvas's pixels, not just the counter
        assert sum(c != 0 for c in classes_of(state["lastFrame"])) == used
        assert by_testid(driver, "cell-stats").text == stats_line(state["lastFrame"])
        # Hovering an occupied bucket shows what /cells/at says of its first cell.
        cell = next(i for i, c in enumerate(classes_of(state["lastFrame"])) if c != 0)
        hover_bucket(driver, cell)
        status, info = live.get(f"/cells/at?cell={cell}")
        assert status == 200 and info["position"] is not None, info
        want = (f"cell {cell} (bucket covers {cell}..{cell}): position {info['position']}, "
                f"owners [{', '.join(map(str, info['owners']))}], cached prefix: {'yes' if info['cached'] else 'no'}")
        tip = driver.find_element("id", "tip")
        wait_for(driver, f"the tooltip {want!r}", lambda d: tip.is_displayed() and tip.text == want)
        assert console_problems(driver) == []


def record_requests(driver) -> None:
    """From now on, the JSON body of every request the page sends is kept in `window.sent`."""
    driver.execute_script("""window.sent = []; const fetch0 = window.fetch;
        window.fetch = (url, init) => { if (init && init.body) window.sent.push(JSON.parse(init.body));
                                        return fetch0(url, init); };""")


def fits_without_scrolling(driver, element) -> dict:
    """Where `element` lies against the viewport, its panel (`#map`) and the page's scroll sizes."""
    return driver.execute_script("""
        const r = arguments[0].getBoundingClientRect(), m = document.getElementById("map");
        const p = m.getBoundingClientRect(), d = document.documentElement;
        return {tip: [r.left, r.top, r.right, r.bottom], panel: [p.left, p.top, p.right, p.bottom],
                viewport: [d.clientWidth, d.clientHeight], page_scroll: [d.scrollWidth, d.scrollHeight],
                panel_scroll: [m.scrollWidth, m.scrollHeight], panel_client: [m.clientWidth, m.clientHeight]};""",
                                 element)


def test_a_tooltip_of_twenty_owners_wraps_inside_the_panel(driver, tiny_loaded, artifacts):
    """A cell 20 samples share (one request, n=20, on a slowed model) has a long tooltip: it wraps
    inside the map's panel and adds no scrollbar, to the page or to the panel."""
    config = {**ONE_CELL_PER_BUCKET, "cache": {"capacity": 2048, "max_seqs": 32}, "server": {"max_sequences": 24}}
    shot = artifacts / "page-long-tooltip.png"
    shot.unlink(missing_ok=True)
    with serving(tiny_loaded, config, model=SlowModel(tiny_loaded[0], 0.05)) as live, opened(driver, live):
        before = fits_without_scrolling(driver, by_testid(driver, "cell-map"))
        assert before["page_scroll"] == before["viewport"], before  # the page does not scroll to begin with
        done: dict = {}

        def twenty() -> None:
            done["answer"] = live.post("/v1/chat/completions", {
                "model": live.model, "n": 20, "temperature": 1, "seed": 7, "max_tokens": 80,
                "messages": [{"role": "user", "content": "Twenty answers to one question, please."}]})

        client = threading.Thread(target=twenty, daemon=True)
        client.start()
        try:
            def twenty_live(d) -> bool:
                assert done.get("answer", (200,))[0] == 200, done  # refused: say so now, not after the wait
                return len(map_state(d)["lastFrame"]["live"]) == 20

            wait_for(driver, "a frame with 20 live sequences", twenty_live)
            shared = classes_of(map_state(driver)["lastFrame"]).index(2)  # a prompt cell: all 20 hold it
            hover_bucket(driver, shared)
            tip = driver.find_element("id", "tip")

            def shows_what_the_server_says(d) -> bool:  # /cells/at's answer, 20 samples' owners and more
                status, info = live.get(f"/cells/at?cell={shared}")
                assert status == 200, info
                want = (f"cell {shared} (bucket covers {shared}..{shared}): position {info['position']}, "
                        f"owners [{', '.join(map(str, info['owners']))}], cached prefix: no")
                return len(info["owners"]) >= 20 and tip.is_displayed() and tip.text == want

            wait_for(driver, "the tooltip to list the shared cell's 20+ owners", shows_what_the_server_says)
            where = fits_without_scrolling(driver, tip)
            assert driver.save_screenshot(str(shot))
        finally:
            client.join(WAIT_S)
        assert not client.is_alive() and done["answer"][0] == 200, done
        (left, top, right, bottom), (pl, pt, pr, pb) = where["tip"], where["panel"]
        assert pl <= left and right <= pr and pt <= top and bottom <= pb, where  # inside the panel
        assert 0 <= left and right <= where["viewport"][0] and 0 <= top and bottom <= where["viewport"][1], where
        assert bottom - top > 20, f"a tooltip this long wraps onto several lines: {where}"
        assert where["page_scroll"] == where["viewport"], f"the tooltip made the page scroll: {where}"
        assert where["panel_scroll"][0] == where["panel_client"][0], f"the tooltip made the panel scroll: {where}"
        assert shot.read_bytes()[:8] == PNG_MAGIC
        assert console_problems(driver) == []


def test_stop_aborts_the_answer_and_the_server_frees_its_request(driver, tiny_loaded, artifacts):
    """Stop, mid-answer on a slowed model: the request is gone from /health within a bound, its
    generation stops well short of the whole answer, and the shown part stays in the conversation."""
    question = "Tell me a long story about caches."
    with serving(tiny_loaded, ONE_CELL_PER_BUCKET, model=SlowModel(tiny_loaded[0], 0.03)) as live, \
            opened(driver, live):
        stop = by_testid(driver, "chat-stop")
        assert not stop.is_enabled(), "Stop with nothing to stop"
        field = by_testid(driver, "chat-max-tokens")
        field.clear()
        field.send_keys("200")
        generated = live.get("/stats")[1]["generated_tokens"]
        by_testid(driver, "chat-input").send_keys(question)
        click_send(driver)
        wait_for(driver, "an assistant bubble", lambda d: all_by_testid(d, "assistant-message"))
        bubble = all_by_testid(driver, "assistant-message")[0]
        wait_for(driver, "some of the answer", lambda d: bubble.text.strip() != "")
        assert live.health()["requests"]["running"] == 1
        assert stop.is_enabled() and not by_testid(driver, "chat-send").is_enabled()
        stop.click()
        wait_for(driver, "the bubble to say it stopped", lambda d: bubble.get_attribute("data-state") == "stopped")
        wait_for(driver, "/health to show no request", lambda d: live.health()["requests"] == {"running": 0,
                                                                                              "waiting": 0}, 10)
        shown, note = driver.execute_script(
            "const b = arguments[0]; return [b.firstChild.textContent, b.lastChild.outerHTML]", bubble)
        assert shown and note == '<span class="stopped">(stopped)</span>', (shown, note)
        assert by_testid(driver, "chat-send").is_enabled() and not stop.is_enabled()
        stopped_at = live.get("/stats")[1]["generated_tokens"] - generated
        time.sleep(0.5)
        assert live.get("/stats")[1]["generated_tokens"] - generated == stopped_at, "it kept generating"
        shot = artifacts / "page-stopped.png"
        assert driver.save_screenshot(str(shot)) and shot.read_bytes()[:8] == PNG_MAGIC
        # The whole answer is far longer than what ran before Stop.
        status, whole, _ = live.post("/v1/chat/completions", {"model": live.model, "temperature": 0,
                                                              "max_tokens": 200,
                                                              "messages": [{"role": "user", "content": question}]})
        assert status == 200 and stopped_at < whole["usage"]["completion_tokens"], (stopped_at, whole["usage"])
        # The next turn sends what was shown of the stopped answer as the assistant's.
        record_requests(driver)
        field.clear()
        field.send_keys("3")
        chat(driver, "Go on.", click_send)
        assert [b["messages"] for b in driver.execute_script("return window.sent")] == [[
            {"role": "user", "content": question}, {"role": "assistant", "content": shown},
            {"role": "user", "content": "Go on."}]]
        assert console_problems(driver) == []


def test_new_chat_clears_the_conversation_and_stops_an_answer(driver, tiny_loaded):
    with serving(tiny_loaded, ONE_CELL_PER_BUCKET, model=SlowModel(tiny_loaded[0], 0.03)) as live, \
            opened(driver, live):
        record_requests(driver)
        field = by_testid(driver, "chat-max-tokens")
        field.clear()
        field.send_keys("3")
        chat(driver, "First question.", click_send)
        by_testid(driver, "chat-new").click()
        assert all_by_testid(driver, "assistant-message") == []
        assert driver.execute_script("return document.getElementById('messages').children.length") == 0
        chat(driver, "A fresh start.", click_send)
        sent = driver.execute_script("return window.sent")
        assert [b["messages"] for b in sent][-1] == [{"role": "user", "content": "A fresh start."}], sent
        # New chat mid-answer stops it too: the server frees the request.
        field.clear()
        field.send_keys("200")
        by_testid(driver, "chat-input").send_keys("A long one.")
        click_send(driver)
        wait_for(driver, "the request to run", lambda d: live.health()["requests"]["running"] == 1)
        by_testid(driver, "chat-new").click()
        assert all_by_testid(driver, "assistant-message") == []
        wait_for(driver, "/health to show no request", lambda d: live.health()["requests"] == {"running": 0,
                                                                                              "waiting": 0}, 10)
        assert by_testid(driver, "chat-send").is_enabled() and not by_testid(driver, "chat-stop").is_enabled()
        field.clear()
        field.send_keys("3")
        chat(driver, "Again.", click_send)
        assert driver.execute_script("return window.sent")[-1]["messages"] == [{"role": "user", "content": "Again."}]
        assert console_problems(driver) == []


def test_temperature_and_max_tokens_are_sent_and_a_bad_one_is_shown_not_sent(driver, tiny_loaded, artifacts):
    with serving(tiny_loaded, ONE_CELL_PER_BUCKET) as live, opened(driver, live):
        record_requests(driver)
        temperature, max_tokens = by_testid(driver, "chat-temperature"), by_testid(driver, "chat-max-tokens")
        error = by_testid(driver, "chat-settings-error")
        assert not error.is_displayed()
        refusals = [(temperature, "2.5", "temperature: expected a number from 0 to 2, not 2.5"),
                    (temperature, "-1", "temperature: expected a number from 0 to 2, not -1"),
                    (max_tokens, "0", "max_tokens: expected a whole number of at least 1, not 0"),
                    (max_tokens, "2.5", "max_tokens: expected a whole number of at least 1, not 2.5"),
                    (max_tokens, "", "max_tokens: expected a whole number of at least 1, not not a number")]
        box = by_testid(driver, "chat-input")
        box.send_keys("Count to three.")
        for field, value, message in refusals:
            field.clear()
            if value:
                field.send_keys(value)
            click_send(driver)
            assert error.is_displayed() and error.text == message, (value, error.text)
            assert field.get_attribute("aria-invalid") == "true"
            if value == "2.5" and field is temperature:
                shot = artifacts / "page-bad-setting.png"
                assert driver.save_screenshot(str(shot)) and shot.read_bytes()[:8] == PNG_MAGIC
            field.clear()
            field.send_keys("0.7" if field is temperature else "3")  # fixing it clears the message
            assert not error.is_displayed() and field.get_attribute("aria-invalid") is None
        assert driver.execute_script("return window.sent") == [], "a bad setting was sent"
        assert all_by_testid(driver, "assistant-message") == [] and box.get_attribute("value") == "Count to three."
        before = live.get("/stats")[1]["generated_tokens"]
        box.clear()
        chat(driver, "Count to three.", click_send)
        sent = driver.execute_script("return window.sent")
        assert [{k: v for k, v in b.items() if k != "messages"} for b in sent] == [
            {"model": live.model, "stream": True, "temperature": 0.7, "max_tokens": 3}]
        settled(driver, live)
        assert 1 <= live.get("/stats")[1]["generated_tokens"] - before <= 3
        assert console_problems(driver) == []


def test_screenshot_with_four_streaming_clients(driver, tiny_loaded, artifacts):
    """A screenshot while four clients stream prompts that share a prefix, on a model slowed so a
    burst outlasts several frames (the page gets one at most every 0.2 s); up to three bursts run
    (each with its own prefix: a cached one would make it shorter) until the screenshot is taken
    on a frame with two or more live sequences."""
    shared = ("You are a careful assistant who explains how a paged key-value cache stores the keys and "
              "values of every token of every sequence, and how prompts that begin the same share cells. ")
    asks = ["What is a cell?", "What is a bucket?", "What happens on preemption?", "Why share prefixes?"]
    shot = artifacts / "page-4-clients.png"
    shot.unlink(missing_ok=True)
    # Each forward slowed to 30 ms: a burst outlasts several frames on any machine.
    with serving(tiny_loaded, ONE_CELL_PER_BUCKET, model=SlowModel(tiny_loaded[0], 0.03)) as live, opened(driver, live):
        client = live.client()
        shown, seen = None, []  # the frame the screenshot shows; (live, shared) of the frames polled
        for burst in range(3):
            answers: dict[int, str] = {}
            errors: list[BaseException] = []

            def one(i: int) -> None:
                prompt = f"Session {burst}. {shared * 3}{asks[i]}"
                try:
                    stream = client.chat.completions.create(
                        model=live.model, messages=[{"role": "user", "content": prompt}],
                        stream=True, temperature=0, max_tokens=40)
                    answers[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(asks))]
            for t in threads:
                t.start()
            deadline = time.monotonic() + WAIT_S
            try:
                while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
                    state = map_state(driver)
                    frame = state["lastFrame"]
                    seen.append((len(frame["live"]), frame["shared_live"]))
                    if shown is None and len(frame["live"]) >= 2:
                        assert driver.save_screenshot(str(shot))
                        if map_state(driver)["frames"] == state["frames"]:  # no newer frame drawn meanwhile
                            shown = frame
                    time.sleep(0.05)
            finally:
                for t in threads:
                    t.join(WAIT_S)
            assert not errors, errors
            assert not any(t.is_alive() for t in threads), "a client did not finish"
            assert sorted(answers) == [0, 1, 2, 3] and all(answers.values()), answers
            if shown is not None:
                break
        assert shown is not None, (
            f"no screenshot on a frame with 2+ live sequences in 3 bursts; (live, shared) seen: {seen}"
        )
        assert shot.read_bytes()[:8] == PNG_MAGIC
        assert any(n >= 2 and cells > 0 for n, cells in seen), f"no frame showed the shared prefix: {seen}"
        stats = settled(driver, live)  # every client done: no live sequence, the map matches /stats
        assert map_state(driver)["lastFrame"]["live"] == [] and stats["cells"]["live_sequences"] == 0, stats
        assert map_state(driver)["drawnOccupied"] == stats["cells"]["used"]
        assert console_problems(driver) == []


# -- the trace page


def hand_made_frames() -> list[dict]:
    def frame(step: int, runs: list[tuple[int, int, int]], live: list[int]) -> dict:
        classes = bytearray(256)
        for start, stop, cls in runs:
            classes[start:stop] = bytes([cls]) * (stop - start)
        used = sum(c != 0 for c in classes)
        return {"step": step, "capacity": 256, "bucket": 1, "buckets": 256,
                "classes": base64.b64encode(bytes(classes)).decode(), "used": used, "free": 256 - used,
                "live": live, "cached": sum(c == 1 for c in classes), "shared": sum(c == 2 for c in classes)}

    return [frame(3, [(0, 10, 3)], [0]),  # one sequence, 10 cells
            frame(9, [(0, 10, 1), (10, 15, 2), (15, 35, 4), (40, 42, 5)], [1, 2])]


def test_trace_page_scrubs_between_its_frames(driver, tmp_path):
    from selenium.webdriver.common.keys import Keys

    template = assembled("trace.html")
    assert template.count(PLACEHOLDER) == 1
    frames = hand_made_frames()
    page = tmp_path / "trace.html"
    page.write_text(template.replace(PLACEHOLDER, json.dumps(frames)))
    driver.get(page.as_uri())
    scrubber, stats = by_testid(driver, "trace-scrubber"), by_testid(driver, "cell-stats")

    def showing(i: int) -> Callable:
        def check(d) -> bool:
            state = map_state(d) or {}
            on_the_frame = (state.get("lastFrame") or {}).get("step") == frames[i]["step"]
            return on_the_frame and stats.text == stats_line(frames[i])
        return check

    wait_for(driver, "the busiest frame (the second: 37 cells against 10) on load", showing(1))
    assert map_state(driver)["drawnOccupied"] == 37 and drawn_non_free(driver) == 37
    assert scrubber.get_attribute("max") == "1" and scrubber.get_attribute("value") == "1"
    scrubber.send_keys(Keys.ARROW_LEFT)
    wait_for(driver, "the first frame after the scrubber moved", showing(0))
    assert map_state(driver)["drawnOccupied"] == 10 and drawn_non_free(driver) == 10
    assert scrubber.get_attribute("value") == "0"
    scrubber.send_keys(Keys.ARROW_RIGHT)
    wait_for(driver, "the second frame after the scrubber moved", showing(1))
    assert map_state(driver)["drawnOccupied"] == 37 and drawn_non_free(driver) == 37
    hover_bucket(driver, 12)
    tip = driver.find_element("id", "tip")
    shared_tip = "cell 12: shared by several live sequences"
    wait_for(driver, "the trace's tooltip", lambda d: tip.is_displayed() and tip.text == shared_tip)
    scrubber.send_keys(Keys.ARROW_LEFT)
    wait_for(driver, "the first frame again", showing(0))
    by_testid(driver, "trace-play").click()  # plays to the last frame and stops there
    wait_for(driver, "play to reach the last frame", showing(1))
    wait_for(driver, "play to stop at the end", lambda d: by_testid(d, "trace-play").text == "Play")
    assert scrubber.get_attribute("value") == "1"
    assert map_state(driver)["frames"] >= 4
    assert console_problems(driver) == []


def test_trace_page_opens_on_its_busiest_frame(driver, tmp_path, artifacts):
    """25 frames as a run makes them (an empty table first, filling, then freed): the page written
    by kvlayout.server.trace.write opens on the frame with the most occupied cells, not frame 1."""
    from kvlayout.server import trace

    def frame(step: int, occupied: int) -> dict:
        classes = bytes([3 + (i // 16) % 4 if i < occupied else 0 for i in range(512)])
        return {"step": step, "capacity": 512, "bucket": 1, "buckets": 512,
                "classes": base64.b64encode(classes).decode(), "used": occupied, "free": 512 - occupied,
                "live": sorted({(i // 16) % 4 for i in range(occupied)}), "cached": 0, "shared": 0}

    occupancy = [0, 0, 12, 40, 75, 110, 150, 190, 230, 260, 300, 330, 351, 340, 320, 300, 280, 240, 200, 150,
                 100, 60, 30, 10, 0]
    frames = [frame(step, n) for step, n in enumerate(occupancy)]
    occupied = [sum(c != 0 for c in classes_of(f)) for f in frames]  # counted from the frames' bytes
    most = max(occupied)
    busiest = occupied.index(most)
    assert most > 0 and busiest not in (0, len(frames) - 1)
    page = tmp_path / "trace.html"
    trace.write(page, frames, "busiest")
    driver.get(page.as_uri())
    wait_for(driver, "a frame drawn", lambda d: (map_state(d) or {}).get("frames", 0) >= 1)
    state = map_state(driver)
    assert state["lastFrame"]["step"] == frames[busiest]["step"]
    assert state["drawnOccupied"] == most and drawn_non_free(driver) == most
    assert by_testid(driver, "trace-scrubber").get_attribute("value") == str(busiest)
    assert by_testid(driver, "trace-position").text == f"{busiest + 1} / {len(frames)}"
    assert by_testid(driver, "cell-stats").text == stats_line(frames[busiest])
    shot = artifacts / "trace-busiest-frame.png"
    assert driver.save_screenshot(str(shot)) and shot.read_bytes()[:8] == PNG_MAGIC
    assert console_problems(driver) == []


def test_trace_page_without_frames_says_so(driver, tmp_path):
    page = tmp_path / "trace.html"
    page.write_text(assembled("trace.html"))  # the frames' placeholder left as it is: null
    driver.get(page.as_uri())
    assert by_testid(driver, "cell-stats").text == "no frames in this trace"
    assert by_testid(driver, "trace-scrubber").get_attribute("disabled") is not None
    assert console_problems(driver) == []


def test_both_pages_draw_with_the_code_written_once_and_load_nothing_from_elsewhere():
    shared = [(STATIC / "cellmap.js").read_text().rstrip("\n"), (STATIC / "cellmap.css").read_text().rstrip("\n")]
    for name in ("index.html", "trace.html"):
        template, text = (STATIC / name).read_text(), assembled(name)
        assert "/*KVLAYOUT_CELLMAP_JS*/" in template and "/*KVLAYOUT_CELLMAP_CSS*/" in template
        assert all(part in text for part in shared) and "KVLAYOUT_CELLMAP" not in text
        assert 'rel="icon" href="data:,"' in text
        assert not re.search(r"""(src|href)=["']https?://""", text), "the pages load nothing from elsewhere"


def test_with_an_api_key_the_page_asks_for_it_keeps_it_for_the_tab_and_then_works(driver, tiny_loaded):
    key = "page-key-0123"
    question = "Tell me about key-value caches in one paragraph."
    with serving(tiny_loaded, {**ONE_CELL_PER_BUCKET, "server": {"api_keys": [key]}}) as live:
        driver.get(f"{live.url}/")
        try:
            form = by_testid(driver, "api-key-form")
            wait_for(driver, "the page to ask for the key", lambda d: form.is_displayed())
            assert (map_state(driver) or {}).get("frames", 0) == 0  # nothing shown before the key
            by_testid(driver, "api-key-input").send_keys("a-wrong-key")
            by_testid(driver, "api-key-submit").click()
            wait_for(driver, "the page to ask again after a wrong key",
                     lambda d: form.is_displayed() and "refused" in by_testid(d, "api-key-note").text)
            by_testid(driver, "api-key-input").send_keys(key)
            by_testid(driver, "api-key-submit").click()
            wait_for(driver, "the key form to go", lambda d: not form.is_displayed())
            wait_for(driver, "the first frame of /cells", lambda d: (map_state(d) or {}).get("frames", 0) >= 1)
            wait_for(driver, "the model id from /v1/models", lambda d: d.find_element("id", "model").text == live.model)
            assert driver.execute_script("return sessionStorage.getItem('kvlayout.apiKey')") == key
            answer = chat(driver, question, click_send)
            status, body, _ = live.post("/v1/chat/completions", {"model": live.model, "temperature": 0,
                                                                 "max_tokens": 128,
                                                                 "messages": [{"role": "user", "content": question}]},
                                        {"Authorization": f"Bearer {key}"})
            assert status == 200 and answer == body["choices"][0]["message"]["content"]
            # A reload in the same tab keeps the key: no question, the map at once.
            driver.refresh()
            wait_for(driver, "the first frame after a reload", lambda d: (map_state(d) or {}).get("frames", 0) >= 1)
            assert not by_testid(driver, "api-key-form").is_displayed()
            # The only console complaints are the refused requests' 401s (the browser logs each).
            assert all("401" in e.get("message", "") for e in console_problems(driver)), console_problems(driver)
        finally:
            driver.get("about:blank")
