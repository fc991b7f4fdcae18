"""The viewer page in a real headless Chromium, driven by selenium.

Needs Debian's `chromium` and `chromium-driver` (`.ci/run` installs them). Without them the
tests skip, except with CI=true, where a browser that cannot start fails the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from viewer_support import SCRIPT_TEXT, small_rollout

from rollout_store import RolloutGraph, TurnNode
from rollout_store.viewer.app import Viewer, serve

pytestmark = pytest.mark.slow

CHROMEDRIVER = "/usr/bin/chromedriver"
TIMEOUT = 20.0
#: The natural width of every image in the turn pane, or false while one is not decoded.
IMAGE_WIDTHS = (
    "return [...document.querySelectorAll('#turn img.content-image')]"
    ".map(i => i.complete && i.naturalWidth)"
)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        profile = tempfile.mkdtemp(prefix="rls-viewer-profile-")
        options = webdriver.ChromeOptions()
        for flag in (
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--window-size=1400,900",
        ):
            options.add_argument(flag)
        if os.path.exists("/usr/bin/chromium"):
            options.binary_location = "/usr/bin/chromium"
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    except Exception as exc:  # no selenium, no chromium, no driver
        if os.environ.get("CI") == "true":
            pytest.fail(f"headless chromium could not start: {exc}")
        pytest.skip(f"headless chromium could not start: {exc}")
    driver.set_page_load_timeout(TIMEOUT)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _open(driver: Any, viewer: Viewer) -> Iterator[float]:
    """Open the page; yields once it is ready, with the seconds from navigation to ready."""
    from selenium.webdriver.support.ui import WebDriverWait

    with serve(viewer) as server:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        start = time.perf_counter()
        driver.get(url)
        WebDriverWait(driver, TIMEOUT, poll_frequency=0.01).until(
            lambda d: d.execute_script(
                "return document.body.dataset.ready || document.body.dataset.error"
            )
        )
        seconds = time.perf_counter() - start
        assert driver.execute_script("return document.body.dataset.error") is None
        yield seconds


class Row:
    """A row of the tree as read in one script call (rows are redrawn on scroll)."""

    def __init__(self, text: str, classes: str) -> None:
        self.text = text
        self.classes = classes


def _rows(driver: Any) -> dict[str, Row]:
    rows = driver.execute_script(
        "return [...document.querySelectorAll('.row')].map(r => [r.dataset.id, r.innerText,"
        " r.className])"
    )
    return {node_id: Row(text, classes) for node_id, text, classes in rows}


def _select(driver: Any, node_id: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.find_element("css selector", f'.row[data-id="{node_id}"]').click()
    WebDriverWait(driver, TIMEOUT).until(
        lambda d: d.execute_script("return document.getElementById('turn').dataset.turn") == node_id
    )


def test_tree_marks_roots_forks_and_discarded(browser: Any) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    graph = small_rollout()
    for _ in _open(browser, Viewer(graph, title="small.rls")):
        rows = _rows(browser)
        assert list(rows) == [
            "t0",
            "t1",
            "t3",
            "t2",
            "shapes",
            "evil",
        ]  # depth first, the fork's children
        assert "root" in rows["t0"].text and "fork x2" in rows["t0"].text
        assert "root" in rows["evil"].text
        assert "discarded" in rows["t2"].text and "is-discarded" in rows["t2"].classes
        assert "discarded" not in rows["t1"].text
        figures = browser.find_element("id", "figures").text
        assert "turns\n6" in figures and "discarded\n1" in figures
        assert "long strings, unique" in figures
        WebDriverWait(browser, TIMEOUT).until(
            lambda d: "KiB" in d.find_element("css selector", "[data-key=received] dd").text
        )
        from selenium.webdriver.common.keys import Keys

        tree = browser.find_element("id", "tree")
        tree.click()
        for key, node_id in ((Keys.ARROW_DOWN, "t1"), ("j", "t3"), (Keys.ARROW_UP, "t1")):
            tree.send_keys(key)
            WebDriverWait(browser, TIMEOUT).until(
                lambda d, node_id=node_id: (
                    d.execute_script("return document.getElementById('turn').dataset.turn")
                    == node_id
                )
            )
        _select(browser, "t3")
        turn = browser.find_element("id", "turn").text
        assert "linked by tokens" in turn
        # the sequence ending at t3 trains the sampled tokens of t0, t1 and t3
        assert "68 tokens over 3 turns, 6 trained (loss mask 1)" in turn
        assert "mask runs: 0x40 1x3 0x20 1x2 0x2 1x1" in turn
        mask = browser.find_elements("css selector", "#turn .mask span")
        assert [s.get_attribute("class") for s in mask][-1] == "m1"
        _select(browser, "t0")
        turn = browser.find_element("id", "turn").text
        assert '"x": 10' in turn and '"y": 20' in turn  # tool call arguments pretty-printed
        assert "click" in turn
        system = "You are a browser agent. " * 60
        assert system not in turn and f"show all {len(system)} characters" in turn
        browser.find_element("css selector", "#turn .long + button").click()
        assert (
            browser.find_element("css selector", "#turn .text.long").text.strip() == system.strip()
        )


def test_images_from_data_urls_and_anthropic_sources(browser: Any) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    graph = small_rollout()
    for _ in _open(browser, Viewer(graph)):
        _select(browser, "t1")
        images = browser.find_elements("css selector", "#turn img.content-image")
        assert len(images) == 2  # the OpenAI image_url part and the Anthropic base64 source
        for image in images:
            assert image.get_attribute("src").startswith("data:image/png;base64,")
        WebDriverWait(browser, TIMEOUT).until(lambda d: d.execute_script(IMAGE_WIDTHS) == [24, 24])


def test_responses_google_and_anthropic_tool_shapes(browser: Any) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    for _ in _open(browser, Viewer(small_rollout())):
        _select(browser, "shapes")
        WebDriverWait(browser, TIMEOUT).until(
            lambda d: d.execute_script(IMAGE_WIDTHS) == [24, 24]  # input_image, inline_data
        )
        turn = browser.find_element("id", "turn").text
        assert "Responses API image:" in turn
        assert "scroll" in turn and '"dy": 300' in turn  # tool_use input pretty-printed
        assert "result of tu_1" in turn and "scrolled" in turn


def test_script_in_a_message_shows_as_text(browser: Any) -> None:
    graph = small_rollout()
    for _ in _open(browser, Viewer(graph)):
        _select(browser, "evil")
        texts = browser.find_elements("css selector", "#turn .text")
        assert [t.text for t in texts] == [SCRIPT_TEXT, SCRIPT_TEXT]
        assert browser.execute_script("return window.__pwned === undefined")
        assert not browser.find_elements("css selector", "#turn script, #turn b, #turn img")
        preview = _rows(browser)["evil"].text
        assert "<script>" in preview


def test_thousand_turn_multimodal_rollout_opens_quickly(browser: Any, tmp_path: Path) -> None:
    path = tmp_path / "long.rls"
    # 100 screenshots of about 37 KB each. Built in a child process: the suite's fixture that
    # round-trips every graph a test builds would export all 1,000 turns again (a minute).
    tests = Path(__file__).resolve().parents[1] / "support"
    script = (
        "import sys, viewer_support; "
        "viewer_support.long_rollout(1000, image_size=96).save(sys.argv[1])"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parents[1]), str(tests)])}
    subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True, timeout=300)
    graph = RolloutGraph.load(path)
    viewer = Viewer(graph, title=path.name, file_size=path.stat().st_size)
    for seconds in _open(browser, viewer):
        open_ms = int(browser.execute_script("return document.body.dataset.openMs"))
        rows = _rows(browser)
        assert 10 < len(rows) < 100  # only the rows on screen are in the page
        assert "turn-0" in rows and "turn-999" not in rows
        entries = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
        )
        assert all(e.startswith("http://127.0.0.1:") for e in entries)  # nothing else reached
        browser.execute_script(
            "const t = document.getElementById('tree'); t.scrollTop = t.scrollHeight;"
        )
        from selenium.webdriver.support.ui import WebDriverWait

        WebDriverWait(browser, TIMEOUT).until(lambda d: "turn-999" in _rows(d))
        _select(browser, "turn-999")
        turn = browser.find_element("id", "turn").text
        assert "2000 (2 new in this turn)" in turn
        assert "show 100 earlier messages" in turn
        # the screenshots of turns 950, 960, ..., 990, decoded
        WebDriverWait(browser, TIMEOUT).until(lambda d: d.execute_script(IMAGE_WIDTHS) == [96] * 5)
        # reported, never asserted: timings are not pass/fail tests
        print(
            f"\n1,000-turn multimodal rollout: page ready {open_ms} ms after navigation start"
            f" (performance.now), {seconds * 1000:.0f} ms from driver.get to ready"
        )


def test_drift_shows_as_a_badge_and_a_figure(browser: Any) -> None:
    graph = RolloutGraph()
    messages: list[dict[str, str]] = [{"role": "user", "content": "q"}]
    prompt = [1, 2, 3]
    for k in range(3):
        sampled = [50, 60 + k]  # thinking (50) the next call's history leaves out
        answer = {"role": "assistant", "content": f"a{k}"}
        graph.add_turn(
            TurnNode(
                request_messages=list(messages),
                response_message=answer,
                prompt_ids=prompt,
                sampled_ids=sampled,
                sampled_logprobs=[-0.5, -0.5],
                node_id=f"d{k}",
            )
        )
        messages += [answer, {"role": "user", "content": f"q{k}"}]
        prompt = [*prompt, 60 + k, 7]
    for _ in _open(browser, Viewer(graph, title="drift.rls")):
        rows = _rows(browser)
        assert "drift" not in rows["d0"].text and "drift @3" in rows["d1"].text
        assert "token drift\n2" in browser.find_element("id", "figures").text
        _select(browser, "d2")
        heading = browser.find_element("css selector", "#turn h2 .badge.drift")
        assert heading.text == "drift @5" and "continues d1" in heading.get_attribute("title")


def test_timeline_lanes_show_engine_and_tool_time(browser: Any) -> None:
    from rollout_store import Timeline

    graph = RolloutGraph()
    base = 1_750_000_000_000_000
    for k, session in enumerate(["agent-a", "agent-b", "agent-a"]):
        node = graph.add_turn(
            TurnNode(
                request_messages=[{"role": "user", "content": f"q{k}"}],
                harness_session_id=session,
                node_id=f"t{k}",
            )
        )
        timeline = Timeline(base + k * 400_000, 100, 150_000, 150_000, 200_000, 210_000)
        if k == 2:  # continues nothing here, but the wait before it is given
            timeline = Timeline(
                base + 800_000, 100, 150_000, 150_000, 200_000, 210_000, gap_before=190_000
            )
        graph.set_timeline(node.node_id, timeline)
    for _ in _open(browser, Viewer(graph, title="timed.rls")):
        lanes = browser.execute_script(
            "return [...document.querySelectorAll('#timeline .lane')].map(l => ["
            "l.querySelector('.lane-name').textContent, l.querySelectorAll('.seg.call').length,"
            " l.querySelectorAll('.seg.engine').length, l.querySelectorAll('.seg.tools').length])"
        )
        assert lanes == [["agent-a", 2, 2, 1], ["agent-b", 1, 1, 0]]
        browser.find_element("css selector", '#timeline .seg.call[data-id="t1"]').click()
        from selenium.webdriver.support.ui import WebDriverWait

        WebDriverWait(browser, TIMEOUT).until(
            lambda d: (
                d.execute_script("return document.getElementById('turn').dataset.turn") == "t1"
            )
        )
        assert "engine" in browser.find_element("id", "turn").text


def test_ids_holding_lone_surrogates_are_shown_and_followed(browser: Any) -> None:
    """The graph keeps a node id or a harness session id with a lone surrogate as it was
    given: the page loads (it failed: encodeURIComponent throws on one), asks for that turn
    and gets it (the server read the query with replacement characters), and puts it in the
    address, which a reload follows."""
    from selenium.webdriver.support.ui import WebDriverWait

    graph = RolloutGraph()
    graph.add_turn(
        TurnNode(
            node_id="odd\ud800id",
            harness_session_id="run\udc00",
            request_messages=[{"role": "user", "content": "the odd one"}],
        )
    )
    graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "a plain one"}]))
    turn_id = "return document.getElementById('turn').dataset.turn"
    for _ in _open(browser, Viewer(graph)):
        rows = browser.execute_script("return [...document.querySelectorAll('.row')]")
        assert len(rows) == 2
        rows[0].click()
        WebDriverWait(browser, TIMEOUT).until(
            lambda d: d.execute_script(turn_id + " === 'odd\\ud800id'")
        )
        # (its text holds the id: the driver cannot hand back a lone surrogate)
        assert browser.execute_script(
            "return document.getElementById('turn').textContent.includes('the odd one')"
        )
        assert browser.execute_script("return location.hash") == "#turn=odd%ED%A0%80id"
        browser.execute_script("location.hash = '#turn=turn-1'")
        WebDriverWait(browser, TIMEOUT).until(lambda d: d.execute_script(turn_id) == "turn-1")
        browser.execute_script("location.hash = '#session=run%ED%B0%80'")
        WebDriverWait(browser, TIMEOUT).until(
            lambda d: d.execute_script(turn_id + " === 'odd\\ud800id'")
        )
