"""In a real browser: Compare and Trade-offs show what each serving layout would hold (kvviz.cache.layouts).

Screenshots land in docs/screenshots/ (docs/layouts.md shows them). The served app and the page are tests/conftest.py's,
the helpers tests/test_browser.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvviz.bench import dom
from tests.test_browser import no_exception, ready, settle, shoot

pytestmark = pytest.mark.browser


def shoot_from(page, name: str, text: str) -> None:
    """Screenshot the view that starts at ``text``, scrolled back past the page's sticky header."""
    page.get_by_text(text).first.evaluate("element => element.scrollIntoView()")
    page.mouse.move(800, 500)  # over the main column, not the sidebar
    page.mouse.wheel(0, -120)
    page.wait_for_timeout(500)
    shoot(page, name)


def test_compare_and_trade_offs_show_what_each_serving_layout_would_hold(server, page):
    """Compare's memory diagnostic draws every layout per configuration at blocks of 16; Trade-offs counts its
    x-axis in a layout the link names (a single prompt: quick)."""
    ready(page, f"{server}/Compare?show=Memory&n=4", "Run comparison").click()
    page.get_by_text("What a serving engine would free").wait_for(timeout=300_000)
    settle(page)
    no_exception(page)
    body = page.inner_text("body")
    assert "paged, shared blocks" in body and "KV-Compress" in body and "Block size" in body
    page.locator(dom.PLOT).nth(2).wait_for(timeout=60_000)
    chart = page.locator(dom.PLOT).nth(2).inner_text()
    assert "blocks of 16 token slots" in chart and "paged per head" in chart
    shoot_from(page, "compare-layouts", "What a serving engine would free")

    # another block size: the chart and the JSON download follow it
    page.locator(dom.SELECTBOX).filter(has_text="Block size").click()
    page.get_by_role("option", name="32", exact=True).click()
    page.get_by_text("blocks of 32 token slots").first.wait_for(timeout=60_000)
    settle(page)
    with page.expect_download() as download:
        page.get_by_role("button", name="Results as JSON").click()
    saved = json.loads(Path(download.value.path()).read_text())
    assert saved["block_size"] == 32 and "block=32" in page.url, (saved["block_size"], page.url)

    ready(page, f"{server}/Trade_offs?w=prompt&m=streaming_llm&m=snapkv&b=0.125&b=0.25&b=0.5&n=4"
               "&x=paged_shared", "Run the sweep").click()
    page.get_by_text("Memory counted").wait_for(timeout=600_000)
    settle(page)
    no_exception(page)
    page.locator(dom.PLOT).first.wait_for(timeout=60_000)
    chart = page.locator(dom.PLOT).first.inner_text()
    assert "paged, shared blocks" in chart and "frontier" in chart, "the frontier, found on the layout's bytes"
    body = page.inner_text("body")
    assert "smaller than full (paged, shared blocks), is inconclusive" in body, "the summary counts the layout"
    assert "Compressions count what paged, shared blocks would hold" in body, "and so do the cliffs"
    shoot_from(page, "tradeoffs-layouts", "Memory counted")
