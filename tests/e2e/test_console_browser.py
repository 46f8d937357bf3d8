"""The web console in headless Chromium (Debian's, driven by Playwright) against a server with
an API key: live requests (a wrong key from a test client shows up as a 401 row within a
second), the playground (a streamed answer, the effective parameters), a session forked and
continued, the metrics charts drawn after traffic, the models page. Screenshots of each page
go to the test's output folder."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import ServerProcess

pytestmark = pytest.mark.e2e
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
sync_api = pytest.importorskip("playwright.sync_api")
if not Path(CHROMIUM).exists():
    pytest.skip("Debian's chromium is not installed (make test installs it)", allow_module_level=True)

KEY = "sk-console-test"
BROWSER_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess(extra_flags=["--api-key", KEY]).start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def page(server: ServerProcess) -> Iterator[object]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 860})
        tab = context.new_page()
        tab.goto(f"{server.base_url}/console")
        tab.fill("#key", KEY)
        tab.dispatch_event("#key", "change")
        yield tab
        browser.close()


def test_a_refused_request_shows_as_a_row_within_a_second(
    page: object, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    page.wait_for_selector("body[data-following='yes']", timeout=30_000)  # type: ignore[attr-defined]
    probe = "/v1/models/console-probe"  # a path of its own: its row is told apart from the page's
    refused = httpx.get(f"{server.base_url}{probe}", headers={"authorization": "Bearer wrong"})
    assert refused.status_code == 401
    started = time.monotonic()
    row = page.locator("#request-rows tr[data-status='401']", has_text=probe)  # type: ignore[attr-defined]
    row.wait_for(timeout=5000)
    assert time.monotonic() - started < 1.0
    row.dispatch_event("click")  # (rows are prepended live: a mouse click can land on a newer one)
    page.wait_for_function(  # type: ignore[attr-defined]
        "document.getElementById('request-detail').textContent.includes('console-probe')"
    )
    detail = page.inner_text("#request-detail")  # type: ignore[attr-defined]
    assert '"error_kind": "unauthorized"' in detail and '"status": 401' in detail
    # its headers as the server kept them, the key redacted; the refusal's body
    page.wait_for_function("document.querySelector('#request-detail pre.body') !== null")  # type: ignore[attr-defined]
    shown = page.inner_text("#request-detail")  # type: ignore[attr-defined]
    assert "authorization: [redacted]" in shown and "Bearer wrong" not in shown
    assert "invalid_api_key" in shown
    page.screenshot(path=str(tmp_path_factory.getbasetemp() / "console-requests.png"), full_page=True)  # type: ignore[attr-defined]


def test_playground_streams_an_answer(page: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    page.click("#tabs button[data-tab='playground']")  # type: ignore[attr-defined]
    page.wait_for_selector("#pg-model option", state="attached")  # type: ignore[attr-defined]
    page.fill("#pg-temperature", "0")  # type: ignore[attr-defined]
    page.fill("#pg-max-tokens", "16")  # type: ignore[attr-defined]
    page.fill("#prompt", "What is the capital of France?")  # type: ignore[attr-defined]
    page.click("#send")  # type: ignore[attr-defined]
    page.wait_for_function("document.getElementById('chat-status').textContent === 'done'", timeout=120_000)  # type: ignore[attr-defined]
    answer = page.locator("#chat .msg.assistant").last.inner_text()  # type: ignore[attr-defined]
    assert len(answer.strip()) > 3
    effective = page.inner_text("#pg-effective")  # type: ignore[attr-defined]
    assert '"temperature": 0' in effective and '"max_tokens": 16' in effective
    page.screenshot(path=str(tmp_path_factory.getbasetemp() / "console-playground.png"), full_page=True)  # type: ignore[attr-defined]


def test_fork_a_session_and_continue_it(page: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    page.click("#tabs button[data-tab='sessions']")  # type: ignore[attr-defined]
    page.wait_for_selector("#session-rows tr")  # type: ignore[attr-defined]
    page.locator("#session-rows tr").first.click()  # type: ignore[attr-defined]
    page.wait_for_selector("#session-detail button.fork")  # type: ignore[attr-defined]
    page.screenshot(path=str(tmp_path_factory.getbasetemp() / "console-sessions.png"), full_page=True)  # type: ignore[attr-defined]
    page.locator("#session-detail button.fork").first.click()  # type: ignore[attr-defined]
    page.wait_for_function("document.getElementById('chat-status').textContent.startsWith('continuing fork')")  # type: ignore[attr-defined]
    assert page.locator("#chat .msg.user").count() >= 1  # type: ignore[attr-defined]
    page.fill("#prompt", "And of Italy?")  # type: ignore[attr-defined]
    page.click("#send")  # type: ignore[attr-defined]
    page.wait_for_function("document.getElementById('chat-status').textContent === 'done'", timeout=120_000)  # type: ignore[attr-defined]
    assert page.locator("#chat .msg.assistant").last.inner_text().strip()  # type: ignore[attr-defined]


def test_metrics_charts_and_models(page: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    page.click("#tabs button[data-tab='metrics']")  # type: ignore[attr-defined]
    page.wait_for_function(
        "document.querySelectorAll('#charts svg polyline.series').length >= 4", timeout=10_000
    )  # type: ignore[attr-defined]
    titles = page.inner_text("#charts")  # type: ignore[attr-defined]
    assert "tokens/s" in titles and "TTFT" in titles
    page.screenshot(path=str(tmp_path_factory.getbasetemp() / "console-metrics.png"), full_page=True)  # type: ignore[attr-defined]
    page.click("#tabs button[data-tab='models']")  # type: ignore[attr-defined]
    page.wait_for_selector("#model-rows tr")  # type: ignore[attr-defined]
    assert "smollm2" in page.inner_text("#model-rows")  # type: ignore[attr-defined]
    page.screenshot(path=str(tmp_path_factory.getbasetemp() / "console-models.png"), full_page=True)  # type: ignore[attr-defined]
