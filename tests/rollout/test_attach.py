"""What a run checks of a server it attaches to, before anything else: each wrong server ends the
run with its real reason in one line. Fake HTTP servers play the wrong ones; the real `vllm serve`
cases are in test_server.py."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from m2po_cli.rollout.server import GENERATE, EngineError, EngineServer
from m2po_cli.rollout.worker import model_signature

SIGNATURE = model_signature({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 64})
VLLM_CONFIG = {
    "scheduler_config": {"max_num_seqs": 64},
    "model_config": {"logprobs_mode": "processed_logprobs"},
}


def routes(**changes) -> dict[str, tuple[int, object]]:
    """What a good server answers on each route, with `changes` (route -> (status, body))."""
    good = {
        "/health": (200, ""),
        "/v1/models": (200, {"data": [{"id": "policy", "max_model_len": 128}]}),
        "/server_info": (200, {"vllm_config": VLLM_CONFIG}),
        GENERATE: (200, {"choices": []}),
        "/collective_rpc": (200, {"results": [SIGNATURE]}),
    }
    return good | {
        route.replace("_", "/") if route.startswith("_") else route: v for route, v in changes.items()
    }


@pytest.fixture
def fake():
    """Start a fake server answering `routes`; returns its URL."""
    servers = []

    def start(answers: dict[str, tuple[int, object]]) -> str:
        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                status, body = answers.get(self.path.split("?")[0], (404, {"detail": "Not Found"}))
                if body == "hang":
                    time.sleep(30)  # longer than any deadline of the test
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()


def check(url: str, signature: dict = SIGNATURE, max_model_len: int = 96) -> EngineServer:
    server = EngineServer(url)
    server.check(signature, max_model_len)
    return server


def test_a_good_server_passes_and_tells_its_concurrency_and_model_name(fake):
    server = check(fake(routes()))
    assert (server.max_num_seqs, server.model_name) == (64, "policy")


HTML = (
    "<html>\n<head><title>404 Not Found</title></head>\n<body>\n" + "<p>nginx</p>\n" * 12 + "</body></html>"
)

CASES = {
    "not-vllm": (routes(**{"/health": (404, HTML)}), "answers HTTP 404 on /health: not a vLLM server"),
    "no-model": (routes(**{"/v1/models": (200, {"data": []})}), "serves no model"),
    "too-short": (
        routes(**{"/v1/models": (200, {"data": [{"id": "m", "max_model_len": 64}]})}),
        "serves at most 64 tokens per sequence; the recipe needs 96",
    ),
    "no-dev-mode": (routes(**{"/server_info": (404, {"detail": "Not Found"})}), "VLLM_SERVER_DEV_MODE=1"),
    "raw-logprobs": (
        routes(
            **{
                "/server_info": (
                    200,
                    {"vllm_config": {**VLLM_CONFIG, "model_config": {"logprobs_mode": "raw_logprobs"}}},
                )
            }
        ),
        "--logprobs-mode processed_logprobs",
    ),
    "no-scale-out": (routes(**{GENERATE: (403, {"error": "disabled"})}), "--enable-scale-out"),
    "no-extension": (routes(**{"/collective_rpc": (500, HTML)}), "--worker-extension-cls"),
    "other-model": (
        routes(**{"/collective_rpc": (200, {"results": [{**SIGNATURE, "hidden_size": 128}]})}),
        "hidden_size 64 here, 128 there",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_wrong_server_is_refused_in_one_line_with_its_reason(fake, case):
    answers, reason = CASES[case]
    url = fake(answers)
    with pytest.raises(EngineError) as info:
        check(url)
    message = str(info.value)
    assert message.startswith(f"rollout server {url} ") and reason in message, message
    assert "\n" not in message and len(message) < 400, "an error page is not an error line"


def test_a_server_that_stops_answering_stops_the_learner_within_the_deadline(fake, char_tokenizer):
    """A server that takes requests and never answers them (hung, or far too slow): the learner's
    wait ends at `rollout.request_timeout_s` with one line naming the server, not at the collective
    timeout an hour later."""
    from m2po_cli.config import DataConfig, RolloutConfig, SyntheticConfig
    from m2po_cli.data import PromptBatches, load_problems
    from m2po_cli.rollout.producer import RolloutProducer
    from m2po_cli.schedule import Schedule

    url = fake(routes(**{GENERATE: (200, "hang")}))
    data = DataConfig(source="synthetic:arithmetic", synthetic=SyntheticConfig(num_problems=16))
    prompts = PromptBatches(load_problems(data), char_tokenizer, data, 2)
    cfg = RolloutConfig(n=2, request_timeout_s=2)
    producer = RolloutProducer([EngineServer(url)], prompts, cfg, Schedule(2, 2, 2), 1, 0)
    producer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineError) as info:
            producer.take(2, 0)
    finally:
        producer.stop()
    assert time.monotonic() - t0 < 10
    # The request's own deadline or the learner's wait, whichever fires first: both name the server.
    message = str(info.value)
    assert url in message and "2 s (rollout.request_timeout_s)" in message, message
