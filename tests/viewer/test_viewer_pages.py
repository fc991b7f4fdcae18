"""The viewer page as a new user sees it, in headless Chromium: screenshots of each view are
written to a temporary folder (printed) to be looked at, and what they show is asserted.

Needs Debian's `chromium` and `chromium-driver`, as tests/viewer/test_viewer_browser.py does.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_viewer_browser import TIMEOUT, _rows, _select, browser  # noqa: F401 - the fixture
from viewer_support import data_url, small_rollout

from rollout_store import RolloutGraph, TurnNode
from rollout_store.viewer.app import Viewer, serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shots() -> Path:
    """Where the screenshots go: outside the repository, kept after the run to look at."""
    folder = Path(tempfile.mkdtemp(prefix="rls-viewer-shots-"))
    print(f"\nviewer screenshots in {folder}")
    return folder


def _page(driver: Any, viewer: Viewer, fragment: str = "") -> Iterator[str]:
    from selenium.webdriver.support.ui import WebDriverWait

    with serve(viewer) as server:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        driver.get(url + fragment)
        WebDriverWait(driver, TIMEOUT, poll_frequency=0.01).until(
            lambda d: d.execute_script(
                "return document.body.dataset.ready || document.body.dataset.error"
            )
        )
        assert driver.execute_script("return document.body.dataset.error") is None
        yield url


def _turn_text(driver: Any) -> str:
    return str(driver.find_element("id", "turn").text)


def _wait_turn(driver: Any, node_id: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, TIMEOUT).until(
        lambda d: d.execute_script("return document.getElementById('turn').dataset.turn") == node_id
    )


def text_rollout() -> RolloutGraph:
    """Eight turns recorded without token ids, two harness sessions, one retry per chain,
    screenshots in the requests, and one response whose `tool_calls` is 5 (an engine's bug
    recorded with a 200)."""
    graph = RolloutGraph()
    tools = [{"type": "function", "function": {"name": n}} for n in ("click", "type")]
    for session in ("alpha", "beta"):
        messages: list[Any] = [{"role": "system", "content": "You drive a browser."}]
        for k in range(4):
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": f"{session} step {k}: the screen"},
                        {"type": "image_url", "image_url": {"url": data_url(k + 1, size=240)}},
                    ],
                }
            )
            response: dict[str, Any] = {"role": "assistant", "content": f"{session} answer {k}"}
            if session == "beta" and k == 1:
                response = {"role": "assistant", "content": None, "tool_calls": 5}
            node = TurnNode(
                node_id=f"{session}-{k}",
                request_messages=list(messages),
                request_tools=tools,
                response_message=response,
                harness_session_id=session,
            )
            graph.add_turn(node)
            if k == 2:  # a retry of this step, dropped by the harness
                graph.add_turn(
                    TurnNode(
                        node_id=f"{session}-{k}-retry",
                        request_messages=list(messages),
                        request_tools=tools,
                        response_message={"role": "assistant", "content": "retried"},
                        harness_session_id=session,
                    )
                )
            messages.append(response)
    return graph


def test_a_text_rollout_reads_clearly(browser: Any, shots: Path) -> None:  # noqa: F811
    graph = text_rollout()
    viewer = Viewer(graph, title="text.rls", labels=["web-agent", "nightly"])
    for _ in _page(browser, viewer):
        browser.save_screenshot(str(shots / "text-rollout.png"))
        rows = _rows(browser)
        # the broken response is in the tree, previewed as it came
        assert "beta-1" in rows and "tool_calls: 5" in rows["beta-1"].text
        for row in rows.values():  # no empty token figures on a text capture
            assert "p 0 s 0" not in row.text
        assert "p prompt tokens" not in browser.find_element("id", "tree-legend").text
        header = browser.find_element("tag name", "header").text
        assert "tokens received" not in header
        assert "web-agent" in header and "nightly" in header  # the session's labels
        assert "2 sessions" in header and "alpha" in header and "beta" in header
        assert "session alpha" in rows["alpha-0"].text
        # forks as branches: a retry and the turn that went on are siblings, same depth,
        # and the chain after them does not move further right
        left = {
            node_id: browser.execute_script(
                f"return document.querySelector('.row[data-id=\"{node_id}\"]').style.paddingLeft"
            )
            for node_id in ("alpha-2", "alpha-2-retry", "alpha-3")
        }
        assert left["alpha-2"] == left["alpha-2-retry"]
        assert "\u2514" in rows["alpha-2-retry"].text or "\u2514" in rows["alpha-3"].text
        _select(browser, "beta-1")
        turn = _turn_text(browser)
        browser.save_screenshot(str(shots / "broken-tool-calls.png"))
        assert "other fields: tool_calls" in turn
        _select(browser, "alpha-3")
        browser.save_screenshot(str(shots / "turn-new-first.png"))
        turn = _turn_text(browser).lower()  # (headings are drawn in capitals)
        # what is new leads; the history follows, one line a message
        assert turn.index("new in this turn") < turn.index("history: 6 earlier messages")
        assert turn.index("alpha step 3") < turn.index("alpha step 0")
        assert "0 tokens" not in turn and "no token ids were recorded" in turn
        assert "\u2502" in rows["alpha-3"].text  # the chain goes on, its sibling follows
        assert "1 turns" not in turn
        sizes = browser.execute_script(
            "return [...document.querySelectorAll('#turn img.content-image')]"
            ".map(i => i.getBoundingClientRect().width)"
        )
        assert sizes and max(sizes) <= 160  # thumbnails, 240 px images
        browser.find_element("css selector", "#turn .new-messages img.content-image").click()
        full = browser.find_element("css selector", ".lightbox img.full-image")
        assert full.size["width"] == 240
        browser.save_screenshot(str(shots / "image-full-size.png"))
        browser.find_element("css selector", ".lightbox").click()
        assert not browser.find_elements("css selector", ".lightbox")
        # a history line opens whole on a click
        browser.find_element("css selector", "#turn .history-line").click()
        assert "You drive a browser." in _turn_text(browser)


def test_a_turn_and_a_session_have_addresses(browser: Any, shots: Path) -> None:  # noqa: F811
    viewer = Viewer(text_rollout(), title="text.rls")
    for url in _page(browser, viewer, "#turn=beta-2"):
        _wait_turn(browser, "beta-2")
        assert browser.execute_script("return location.hash") == "#turn=beta-2"
        assert "selected" in _rows(browser)["beta-2"].classes
        browser.save_screenshot(str(shots / "turn-address.png"))
        _select(browser, "alpha-1")
        assert browser.execute_script("return location.hash") == "#turn=alpha-1"
        browser.refresh()  # the view comes back
        _wait_turn(browser, "alpha-1")
        browser.get(url + "#session=beta")
        _wait_turn(browser, "beta-0")
        browser.find_element("css selector", 'a.session-link[data-session="alpha"]').click()
        _wait_turn(browser, "alpha-0")


def test_a_token_rollout_explains_its_loss_mask(browser: Any, shots: Path) -> None:  # noqa: F811
    for _ in _page(browser, Viewer(small_rollout(), title="small.rls")):
        _select(browser, "t3")
        browser.save_screenshot(str(shots / "token-turn.png"))
        turn = _turn_text(browser)
        assert "68 tokens over 3 turns" in turn
        assert "context: 0, not trained" in turn and "sampled by the model: 1, trained on" in turn
        assert "each run is value x length" in turn
        assert "p 40 s 3" in _rows(browser)["t0"].text
        _select(browser, "t0")
        assert "43 tokens over 1 turn," in _turn_text(browser)


def test_the_favicon_is_served(browser: Any) -> None:  # noqa: F811
    for url in _page(browser, Viewer(small_rollout())):
        entries = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => [e.name, e.responseStatus])"
        )
        import urllib.request

        for path in ("static/favicon.svg", "favicon.ico"):
            with urllib.request.urlopen(url + path, timeout=10) as response:
                assert response.status == 200
                assert response.headers["Content-Type"] == "image/svg+xml"
                assert response.read().startswith(b"<svg")
        assert not [e for e in entries if e[1] and e[1] >= 400]
