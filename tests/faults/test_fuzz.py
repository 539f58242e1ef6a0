"""Bad input, fuzzed: schemathesis against the router's own OpenAPI schema, over real HTTP.

A real router process with a (fake, in-test) decode worker behind it, so schema-valid
generation requests really run. Every operation gets a few hundred generated requests,
valid and invalid: no undocumented status, no 5xx other than the documented 503/504,
every error in OpenAI's shape (the schema's ``ErrorResponse``), invalid data refused,
and (admin endpoints) valid data accepted.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance
from transformers import AutoTokenizer

from pdserve.common.utils import free_port
from tests.helpers.fake_peers import FakeDecodeWorker, wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def router_url(model_dir):
    port, zmq_port = free_port(), free_port()
    router = subprocess.Popen([sys.executable, "-m", "pdserve", "--log-level", "warning", "router", "--model",
                               model_dir, "--port", str(port), "--zmq-port", str(zmq_port), "--max-model-len", "256",
                               "--request-timeout", "30"])
    url = f"http://127.0.0.1:{port}"
    worker = None
    try:
        wait_for(lambda: _up(url), timeout_s=60)
        worker = FakeDecodeWorker(f"tcp://127.0.0.1:{zmq_port}", max_model_len=256)
        worker.script = AutoTokenizer.from_pretrained(model_dir).encode(" one two three")
        wait_for(lambda: httpx.get(f"{url}/health").json()["num_decode"] == 1, timeout_s=10)
        yield url
    finally:
        if worker is not None:
            worker.close()
        router.kill()
        router.wait()


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def api_schema(router_url):
    return schemathesis.openapi.from_url(f"{router_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_router_answers_what_its_schema_says(case):
    # The sampling ranges (n, temperature, logprobs, ...) are checked in code with vLLM's messages, not
    # written into the schema: there a schema-valid value may rightly get a 400.
    excluded = [positive_data_acceptance] if case.path.startswith("/v1/") else []
    response = case.call_and_validate(timeout=30, excluded_checks=excluded)  # raises on any schema violation
    assert response.status_code != 500, response.text  # documented, but bad input must never reach one
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
