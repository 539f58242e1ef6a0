"""A quantized KV cache through the whole cluster: router + 1 prefill + 1 decode worker as processes,
both ``--kv-cache-dtype int8``. A streamed request is prefilled remotely, its int8 KV (rows with their
scales) crosses the gloo pair, and the decode worker's output is the offline int8 ``LLM``'s; the KV
bytes that moved are the packed rows', (head_dim + 4) / (4 * head_dim) of a float32 cache's."""

from __future__ import annotations

import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.common.utils import free_port
from pdserve.engine.execution.kv_cache import kv_cache_block_bytes
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from tests.helpers.cluster import wait_all_blocks_free, workers
from tests.helpers.cluster import metric_totals, wait_metric_increase

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "4MiB", "--kv-cache-dtype", "int8",
                                    "--remote-prefill-threshold", "4"])
    with LocalCluster(spec, log_dir=str(tmp_path_factory.mktemp("logs"))) as c:
        yield c


def test_int8_kv_streams_end_to_end_with_a_quarter_of_the_bytes(cluster, model_dir):
    assert {w["role"]: w["kv_cache_dtype"] for w in workers(cluster)} == {"prefill": "int8", "decode": "int8"}
    ids = list(range(40, 90))  # 50 tokens: 4 blocks of 16
    api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)
    before = metric_totals(cluster)
    stream = api.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # streamed, not one blob
    int8_block = kv_cache_block_bytes(2, 16, 2, 16, "int8")  # tiny: 2 layers, 2 KV heads, head_dim 16
    # Both workers' heartbeats must be in (each reports its own side of the transfer).
    moved = wait_metric_increase(cluster, "pdserve:kv_transfer_bytes_total", before, 2 * 4 * int8_block)
    assert moved == 2 * 4 * int8_block  # prefill sent + decode received, 4 blocks each
    f32_block = kv_cache_block_bytes(2, 16, 2, 16, "float32")
    assert int8_block / f32_block == pytest.approx((16 + 4) / (4 * 16))
    llm = LLM(model_dir, kv_cache_dtype="int8", kv_cache_memory="4MiB")
    try:
        want = llm.generate([ids], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    finally:
        llm.close()
    assert text == want
    wait_all_blocks_free(cluster)
