"""The playground in a real browser: Debian's Chromium, driven by Playwright,
on the page of a running launcher (a tiny random model that never stops by
itself). A message gets a streamed answer with its speed; Stop aborts the
fetch and the server frees the request's KV blocks; with --api-key (and
--protect-metrics, so that /info needs it too) the page loads without the key
and works once it is typed in.

Skipped, with the reason, where Chromium or the playwright package is missing
(`make test` installs both where apt-get and root allow)."""

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from ..shard_harness import save_tiny_served_model
from .router_harness import launch

try:
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # skipped below, with the reason
    sync_playwright = None

CHROMIUM = Path("/usr/bin/chromium")
KEY = "s3cret-playground"
TIMEOUT_MS = 30_000
MAX_TOTAL_TOKENS = 16384  # an answer of ~16k tokens takes the tiny model far longer than the stop test waits


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: `make test` installs Debian's chromium where apt-get runs as root")
    if sync_playwright is None:
        pytest.skip("the playwright package is not installed (it is in the `test` extra)")
    with sync_playwright() as playwright:
        try:
            chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        except PlaywrightError as err:
            pytest.skip(f"{CHROMIUM} does not start: {str(err).splitlines()[0]}")
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory, browser):
    """(model path, plain server's url, keyed server's url), started side by side."""
    tmp = tmp_path_factory.mktemp("playground_browser")
    model = str(save_tiny_served_model(tmp / "tiny", eos_token_id=None))
    with ThreadPoolExecutor(2) as pool:
        # room for an answer far longer than the time the stop test waits for
        started = [pool.submit(launch, model, tmp / "plain", "--max-total-tokens", str(MAX_TOTAL_TOKENS),
                               "--max-input-tokens", "512", default_limits=False),
                   pool.submit(launch, model, tmp / "keyed", "--api-key", KEY, "--protect-metrics")]
        launched = [f.result() for f in started]
    try:
        yield model, launched[0][1], launched[1][1]
    finally:
        for proc, _ in launched:
            proc.terminate()
        for proc, _ in launched:
            proc.wait(30)


@pytest.fixture
def page(browser):
    context = browser.new_context()  # the page's CSP holds: Playwright's checks below evaluate no strings
    context.set_default_timeout(TIMEOUT_MS)
    expect.set_options(timeout=TIMEOUT_MS)
    errors = []
    page = context.new_page()
    page.on("pageerror", lambda err: errors.append(str(err)))
    # Chromium logs each 4xx as a console error: the keyed server's /info answers 401 before the key is typed.
    page.on("console", lambda msg: errors.append(msg.text)
            if msg.type == "error" and "status of 401" not in msg.text else None)
    yield page
    context.close()
    assert not errors, errors  # no script error, no CSP violation


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def send(page, text: str, max_tokens: int):
    """Sends a message; the locator of the last answer (evaluated when used)."""
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", text)
    page.click("#send")
    return page.locator("#messages li.assistant").last


def test_a_message_gets_a_streamed_answer_with_its_speed(servers, page):
    model, url, _ = servers
    page.goto(url)
    expect(page.locator("#model-id")).to_have_text(model)
    expect(page.locator("#limits [data-field=max_total_tokens] dd")).to_have_text(str(MAX_TOTAL_TOKENS))
    answer = send(page, "Hello", 24)
    page.wait_for_selector("#messages li.assistant[data-state=done]")
    assert answer.locator(".content").text_content() != ""
    stats = answer.locator(".stats").text_content()
    assert "24 tokens" in stats and "ms to first token" in stats and "tokens/s" in stats, stats
    assert float(answer.get_attribute("data-tokens-per-s")) > 0
    assert page.locator("#messages li.user .content").text_content() == "Hello"


def test_each_request_carries_the_conversation_and_the_settings(servers, page):
    _, url, _ = servers
    page.goto(url)
    page.fill("#system", "Be brief.")
    settings = {"#temperature": "0.7", "#top-p": "0.9", "#seed": "3", "#stop-sequences": "END\n\nSTOP"}
    for field, value in settings.items():
        page.fill(field, value)
    send(page, "One", 4)
    page.wait_for_selector("#messages li.assistant[data-state=done]")
    first = page.locator("#messages li.assistant .content").text_content()
    with page.expect_request("**/v1/chat/completions") as sent:
        send(page, "Two", 5)
    page.wait_for_selector("#messages li.assistant:nth-child(4)[data-state=done]")
    body = sent.value.post_data_json
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "One"},
                                {"role": "assistant", "content": first},
                                {"role": "user", "content": "Two"}]
    assert (body["stream"], body["max_tokens"], body["temperature"], body["top_p"], body["seed"], body["stop"]) == \
        (True, 5, 0.7, 0.9, 3, ["END", "STOP"])
    assert "response_format" not in body
    page.click("#clear")
    expect(page.locator("#messages li")).to_have_count(0)


def test_stop_aborts_the_answer_and_the_server_frees_its_kv_blocks(servers, page):
    _, url, _ = servers
    page.goto(url)
    max_tokens = MAX_TOTAL_TOKENS - 64
    answer = send(page, "Tell me a long story", max_tokens)
    expect(answer.locator(".content")).to_have_text(re.compile(".{8}", re.S))  # streaming
    assert metric(url, "tgi_kv_cache_blocks_used") > 0  # the answer holds blocks while it streams
    page.click("#stop")
    stopped = time.monotonic()
    page.wait_for_selector("#messages li.assistant[data-state=stopped]")
    assert "stopped" in answer.locator(".stats").text_content()
    while metric(url, "tgi_kv_cache_blocks_used") != 0 and time.monotonic() < stopped + 10:
        time.sleep(0.05)
    freed = time.monotonic() - stopped
    assert metric(url, "tgi_kv_cache_blocks_used") == 0
    # Freed by the cancellation, long before the answer could have run to its end at its own speed.
    tokens, rate = int(answer.get_attribute("data-tokens")), float(answer.get_attribute("data-tokens-per-s"))
    assert freed < (max_tokens - tokens) / rate / 2, (freed, tokens, rate)
    assert page.is_enabled("#send") and not page.is_enabled("#stop")


def test_an_invalid_json_schema_is_refused_in_the_page(servers, page):
    _, url, _ = servers
    page.goto(url)
    page.fill("#json-schema", '{"type": "object",')
    assert "not valid JSON" in page.text_content("#settings-error")
    send(page, "Hi", 4)
    assert page.locator("#messages li").count() == 0  # nothing sent
    assert page.input_value("#prompt") == "Hi"


def test_with_an_api_key_the_page_loads_without_it_and_answers_with_it(servers, page):
    model, _, url = servers
    response = page.goto(url)
    assert response.status == 200
    expect(page.locator("#info-status")).to_contain_text("needs an API key")
    page.fill("#api-key", KEY)
    page.dispatch_event("#api-key", "change")
    expect(page.locator("#model-id")).to_have_text(model)
    expect(page.locator("#info-status")).to_have_text("")
    answer = send(page, "Hello", 6)
    page.wait_for_selector("#messages li.assistant[data-state=done]")
    assert "6 tokens" in answer.locator(".stats").text_content()


def test_a_json_schema_shapes_the_answer(servers, page):
    _, url, _ = servers
    page.goto(url)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    page.fill("#json-schema", json.dumps(schema))
    page.fill("#seed", "7")  # the same answer every run
    answer = send(page, "Answer in JSON", 48)
    page.wait_for_selector("#messages li.assistant[data-state=done]")
    assert set(json.loads(answer.locator(".content").text_content())) == {"ok"}
