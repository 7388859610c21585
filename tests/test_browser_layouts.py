"""In a real browser: Compare and Trade-offs show what each serving layout would hold (kvviz.cache.layouts).

Screenshots land in docs/screenshots/ (docs/layouts.md shows them). The served app is tests/conftest.py's, the helpers
tests/test_browser.py's."""

from __future__ import annotations

import pytest

from tests.test_browser import _browser, no_exception, settle, shoot

pytestmark = pytest.mark.browser


def shoot_from(page, name: str, text: str) -> None:
    """Screenshot the view that starts at ``text``, scrolled back past the page's sticky header."""
    page.get_by_text(text).first.evaluate("element => element.scrollIntoView()")
    page.mouse.move(800, 500)  # over the main column, not the sidebar
    page.mouse.wheel(0, -120)
    page.wait_for_timeout(500)
    shoot(page, name)


def test_compare_and_trade_offs_show_what_each_serving_layout_would_hold(server):
    """Compare's memory diagnostic draws every layout per configuration at blocks of 16; Trade-offs counts its
    x-axis in a layout the link names (a single prompt: quick)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = _browser(playwright)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{server}/Compare?show=Memory&n=4", timeout=120_000)
            page.get_by_role("button", name="Run comparison").wait_for(timeout=180_000)
            settle(page)
            page.get_by_role("button", name="Run comparison").click()
            page.get_by_text("What a serving engine would free").wait_for(timeout=300_000)
            settle(page)
            no_exception(page)
            body = page.inner_text("body")
            assert "paged, shared blocks" in body and "KV-Compress" in body and "Block size" in body
            page.locator(".js-plotly-plot").nth(2).wait_for(timeout=60_000)
            chart = page.locator(".js-plotly-plot").nth(2).inner_text()
            assert "blocks of 16 token slots" in chart and "paged per head" in chart
            shoot_from(page, "compare-layouts", "What a serving engine would free")

            page.goto(f"{server}/Trade_offs?w=prompt&m=streaming_llm&m=snapkv&b=0.125&b=0.25&b=0.5&n=4"
                      "&x=paged_shared", timeout=120_000)
            page.get_by_role("button", name="Run the sweep").wait_for(timeout=180_000)
            settle(page)
            page.get_by_role("button", name="Run the sweep").click()
            page.get_by_text("Memory on the x-axis").wait_for(timeout=600_000)
            settle(page)
            no_exception(page)
            page.locator(".js-plotly-plot").first.wait_for(timeout=60_000)
            chart = page.locator(".js-plotly-plot").first.inner_text()
            assert "paged, shared blocks" in chart
            shoot_from(page, "tradeoffs-layouts", "Memory on the x-axis")
        finally:
            browser.close()
