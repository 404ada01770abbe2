"""The chat page at ``/`` in a real headless browser: Debian's Chromium driven by Playwright.

A real ``k3 serve`` on the demo model (keyed, so the page asks for the key), the page loaded
from it: a message sent, its reply streamed in (the thinking channel folded), the figures
shown under it; then a long generation stopped with the Stop button, which the page shows
as stopped and the server's log as cancelled.

Playwright's own browser download is not used: the system's Chromium is launched by path.
Without Chromium or Playwright the test skips, saying which is missing, unless
``K3_TEST_REQUIRE`` names ``browser`` (CI does): then it fails.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Served
from required import required

DEMO = Path(__file__).resolve().parents[2] / "demo-model"
KEY = "sekret"
WAIT_MS = 30_000


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path is not None:
            return path
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    why = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        why = "Playwright is not installed (pip install playwright; it is in the test extra)"
    exe = chromium()
    if why is None and exe is None:
        why = "no Chromium on this machine (apt-get install chromium)"
    if why is not None:
        if "browser" in required():
            pytest.fail(f"a browser is required (K3_TEST_REQUIRE names browser) but {why}")
        pytest.skip(why)
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, headless=True)
        try:
            yield b
        finally:
            b.close()


#: how many characters the last reply shows so far (thinking and response), in the page
SHOWN = """() => {
  const replies = document.querySelectorAll('.msg.assistant');
  const el = replies[replies.length - 1];
  return el ? el.querySelector('.thinking .text').textContent.length
              + el.querySelector('.content').textContent.length : 0;
}"""


def test_the_page_streams_a_reply_and_stops_a_generation(browser):
    from playwright.sync_api import expect

    s = Served(DEMO, "--threads", "1", "--api-key", KEY)
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None)
    try:
        page.goto(s.url + "/")
        status = page.locator("#status")
        expect(status).to_have_text("this server wants an API key", timeout=WAIT_MS)
        page.fill("#apikey", KEY)
        page.click("#savekey")
        expect(status).to_have_text("ready", timeout=WAIT_MS)
        expect(page.locator("#model")).to_have_text("demo-model")

        # a reply, streamed: the thinking channel folded, the figures under it
        page.fill("#max_tokens", "24")
        page.fill("#prompt", "Hello")
        page.press("#prompt", "Enter")
        reply = page.locator(".msg.assistant").last
        expect(reply).to_have_attribute("data-finish", "length", timeout=WAIT_MS)
        thinking = reply.locator("details.thinking")
        shown = {"reasoning": thinking.locator(".text").text_content(),
                 "content": reply.locator(".content").text_content()}
        assert shown["reasoning"] or shown["content"]
        if shown["reasoning"]:
            expect(thinking).to_be_visible()
            assert thinking.evaluate("d => d.open") is False  # folded until opened
            expect(thinking.locator("summary")).to_have_text(f"thinking ({len(shown['reasoning'])} characters)")
        stats = reply.locator(".stats").text_content() or ""
        assert re.search(r"^length · 24 tokens · [\d.]+ tokens/s · first token [\d.]+ s · prompt \d+ \(\d+ "
                         r"cached\) · experts \d+ resident, \d+ read of \d+ lookups$", stats), stats
        # the same as the API gives for the same request (greedy): the page lost and added nothing
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "demo-model", "messages": [{"role": "user", "content": "Hello"}],
                             "max_tokens": 24})
        msg = r.json()["choices"][0]["message"]
        assert shown == {"reasoning": msg["reasoning_content"] or "", "content": msg["content"]}

        # a long generation: text keeps arriving until Stop is pressed
        page.fill("#max_tokens", "3000")
        page.fill("#prompt", "Tell me more")
        page.click("#send")
        expect(page.locator("#stop")).to_be_enabled()
        expect(page.locator(".msg.assistant")).to_have_count(2)
        page.wait_for_function(f"() => ({SHOWN})() > 0", timeout=WAIT_MS)
        first = page.evaluate(SHOWN)
        page.wait_for_function(f"(n) => ({SHOWN})() > n", arg=first, timeout=WAIT_MS)  # still arriving
        page.click("#stop")
        stopped = page.locator(".msg.assistant").last
        expect(stopped).to_have_attribute("data-finish", "stopped", timeout=WAIT_MS)
        expect(status).to_have_text("stopped")
        expect(page.locator("#send")).to_be_enabled()
        expect(page.locator("#stop")).to_be_disabled()
        line = s.wait_line(lambda ln: "POST /v1/chat/completions 200 cancelled" in ln, timeout=30)
        made = int(re.search(r"\+ (\d+) tokens", line).group(1))  # type: ignore[union-attr]
        assert 0 < made < 3000, line
        assert errors == [], errors
    finally:
        page.close()
        rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err
