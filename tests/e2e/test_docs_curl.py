"""Every curl example of the documentation runs, as written, against a real
launcher serving a tiny model, and answers 2xx; the /metrics it then serves
is accepted by Prometheus' own checker."""

import shutil
import subprocess

import httpx
import pytest

from ..deploy.doc_snippets import DOC_HOSTS, Snippet, curl_examples
from ..deploy.prometheus_check import check_exposition
from ..shard_harness import save_tiny_model, save_tiny_tokenizer
from .router_harness import launch

EXAMPLES = curl_examples()
CURL = shutil.which("curl")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs")
    # Byte-level tokens: a tool prompt is a few thousand, so a longer context.
    model = save_tiny_model("llama", tmp / "tiny", vocab_size=320, bos_token_id=256, eos_token_id=257,
                            max_position_embeddings=4096)
    save_tiny_tokenizer(model)
    proc, url = launch(str(model), tmp, "--num-threads", "1", "--max-input-tokens", "3072",
                       "--max-total-tokens", "4096")
    yield url
    proc.terminate()
    proc.wait(60)


def to_server(arg: str, url: str) -> str:
    for host in DOC_HOSTS:
        arg = arg.replace(host, url.removeprefix("http://"))
    return arg


def run_with_curl(argv: list[str], url: str) -> tuple[int, str]:
    argv = [CURL, "-sS", "--max-time", "120", "-o", "-", "-w", "\n%{http_code}", *argv[1:]]
    result = subprocess.run([to_server(a, url) for a in argv],
                            capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr
    body, _, status = result.stdout.rpartition("\n")
    return int(status), body


def run_with_httpx(argv: list[str], url: str) -> tuple[int, str]:
    """Without a curl binary: the subset of curl's options the docs use."""
    method, headers, data, target = "GET", {}, None, None
    args = iter(argv[1:])
    for arg in args:
        if arg == "-X":
            method = next(args)
        elif arg == "-H":
            name, _, value = next(args).partition(":")
            headers[name.strip()] = value.strip()
        elif arg == "-d":
            data, method = next(args), "POST" if method == "GET" else method
        elif arg == "-N":
            continue
        else:
            target = arg
    r = httpx.request(method, "http://" + to_server(target, url),
                      headers=headers, content=data, timeout=120)
    return r.status_code, r.text


def test_the_docs_have_curl_examples_for_every_route():
    targets = [a for s in EXAMPLES for a in s.argv() if a.startswith(DOC_HOSTS[0])]
    routes = {t.removeprefix(DOC_HOSTS[0]).split("?")[0] or "/" for t in targets}
    assert routes >= {"/health", "/info", "/metrics", "/generate", "/generate_stream", "/", "/tokenize",
                      "/chat_tokenize", "/v1/chat/completions", "/v1/completions", "/v1/models", "/docs",
                      "/api-doc/openapi.json"}


@pytest.mark.parametrize("example", EXAMPLES, ids=[s.where for s in EXAMPLES])
def test_curl_example_answers_2xx(server, example: Snippet):
    argv = example.argv()
    assert any(h in a for a in argv for h in DOC_HOSTS), f"{example.where}: curl examples use {DOC_HOSTS[0]}"
    status, body = (run_with_curl if CURL else run_with_httpx)(argv, server)
    assert 200 <= status < 300, f"{example.where}: {status} {body[:300]}"
    assert '"error_type"' not in body, f"{example.where}: {body[:300]}"


def test_metrics_after_the_examples_pass_prometheus_checks(server):
    # Runs after the examples (file order): counters and histograms have data.
    text = httpx.get(server + "/metrics", timeout=10).text
    assert "tgi_request_count" in text
    check_exposition(text)
