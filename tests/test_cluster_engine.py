"""Engine depth through the whole cluster: prefix caching, chunked prefill and
preemption all active at once, and greedy output still equal to transformers.

The decode worker's KV budget (48 blocks of 16 tokens) is far too small for 12
concurrent requests, and the token budget (32) is shorter than most prompts.
"""

from __future__ import annotations

import concurrent.futures as cf
import random

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from tests.helpers.cluster import WORDS, wait_all_blocks_free
from tests.helpers.cluster import metric_totals, wait_metric_increase  # noqa: F401

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers * (K, V) * block_size * kv_heads * head_dim * fp32
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", str(48 * block_bytes), "--max-num-batched-tokens", "32",
                                    "--remote-prefill-threshold", "8"])
    with LocalCluster(spec, log_dir=str(tmp_path_factory.mktemp("logs"))) as c:
        yield c


def test_greedy_matches_transformers_with_prefix_cache_chunking_and_preemption(cluster, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(3)
    system = " ".join(rng.choice(WORDS) for _ in range(40))  # a shared prefix of several blocks
    prompts = [system + " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30))) for _ in range(12)]
    api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=300, max_retries=0)
    before = metric_totals(cluster)

    def run(i):
        return api.completions.create(model="tiny", prompt=prompts[i], max_tokens=40 + i, temperature=0).choices[0]

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        choices = list(pool.map(run, range(len(prompts))))
    for i, (prompt, choice) in enumerate(zip(prompts, choices)):
        ids = tok(prompt).input_ids
        assert len(ids) > 32  # longer than the token budget: prefilled in chunks
        out = ref.generate(torch.tensor([ids]), max_new_tokens=40 + i, do_sample=False)[0, len(ids):]
        assert choice.text == tok.decode(out, skip_special_tokens=True), f"prompt {i} differs from transformers"

    assert wait_metric_increase(cluster, "vllm:num_preemptions_total", before, 1) >= 1, "nothing was preempted"
    assert wait_metric_increase(cluster, "vllm:prefix_cache_hits_total", before, 1) >= 1, "no prefix-cache hit"
    wait_all_blocks_free(cluster)


def test_partial_prefix_hit_sends_only_missing_blocks(cluster, model_dir):
    """Both workers hold the prompt's first blocks: the prefill worker computes only the tail and
    sends only the blocks the decode worker lacks, and the output is still transformers'."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)
    rng = random.Random(11)
    head = " ".join(rng.choice(WORDS) for _ in range(40))
    prompt = head + " " + " ".join(rng.choice(WORDS) for _ in range(40))
    api.completions.create(model="tiny", prompt=head, max_tokens=2, temperature=0)
    wait_all_blocks_free(cluster)  # also waits for the heartbeat that carries those counters
    before = metric_totals(cluster)
    text = api.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    ids = tok(prompt).input_ids
    cached = (len(tok(head).input_ids) - 1) // 16 * 16  # full blocks of the head, on each worker
    assert wait_metric_increase(cluster, "vllm:prefix_cache_hits_total", before, 2 * cached) >= 2 * cached
    sent = wait_metric_increase(cluster, "pdserve:kv_transfer_bytes_total", before, 1)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    total_blocks = -(-len(ids) // 16)
    assert 0 < sent <= 2 * (total_blocks - cached // 16) * block_bytes  # both sides count; only the tail moved
    out = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):]
    assert text == tok.decode(out, skip_special_tokens=True)
    wait_all_blocks_free(cluster)


def test_parallel_sampling_n(cluster):
    api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)
    greedy = api.completions.create(model="tiny", prompt="seven wizards pack", max_tokens=12, temperature=0)
    resp = api.completions.create(model="tiny", prompt="seven wizards pack", max_tokens=12, temperature=0, n=3)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert all(c.text == greedy.choices[0].text for c in resp.choices)
    assert resp.usage.completion_tokens == 3 * greedy.usage.completion_tokens
    sampled = api.completions.create(model="tiny", prompt="seven wizards pack", max_tokens=12, temperature=1.0,
                                     n=4, seed=7)
    again = api.completions.create(model="tiny", prompt="seven wizards pack", max_tokens=12, temperature=1.0,
                                   n=4, seed=7)
    texts = [c.text for c in sorted(sampled.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # the samples differ from each other
    wait_all_blocks_free(cluster)


def test_logprobs_and_penalties(cluster):
    api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)
    resp = api.completions.create(model="tiny", prompt="a river bank", max_tokens=6, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(len(t) == 3 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert "".join(lp.tokens) == resp.choices[0].text
    chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 4
    plain = api.completions.create(model="tiny", prompt="a a a a", max_tokens=20, temperature=0,
                                   extra_body={"ignore_eos": True})
    penalized = api.completions.create(model="tiny", prompt="a a a a", max_tokens=20, temperature=0,
                                       frequency_penalty=2.0, presence_penalty=2.0, extra_body={"ignore_eos": True})
    assert plain.choices[0].text != penalized.choices[0].text
    wait_all_blocks_free(cluster)


def penalized_greedy(model, prompt_ids: list[int], num_tokens: int, frequency: float, presence: float) -> list[int]:
    """Reference: transformers' logits, then OpenAI's penalty formula written out, then argmax.

    logit[t] -= frequency * count(t in output) + presence * (count > 0); the prompt does not count.
    """
    out: list[int] = []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([prompt_ids + out])).logits[0, -1].double()
            for token in set(out):
                logits[token] -= frequency * out.count(token) + presence
            out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("frequency,presence", [(1.5, 0.0), (0.0, 1.5), (0.5, -2.0)])
def test_penalties_equal_a_reference_computation(cluster, model_dir, frequency, presence):
    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)
    prompt = "a a a a the the the"
    ids = tok.encode(prompt)
    resp = api.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0, logprobs=0,
                                  frequency_penalty=frequency, presence_penalty=presence,
                                  extra_body={"ignore_eos": True, "skip_special_tokens": False})
    expected = penalized_greedy(ref, ids, 16, frequency, presence)
    assert resp.choices[0].text == tok.decode(expected)
    assert resp.choices[0].text != tok.decode(penalized_greedy(ref, ids, 16, 0.0, 0.0))  # the penalty mattered
    wait_all_blocks_free(cluster)


def test_short_prompt_is_prefilled_by_the_decode_worker(cluster):
    """Conditional disaggregation: fewer uncached tokens than --remote-prefill-threshold (8) stay local."""
    api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)
    wait_all_blocks_free(cluster)
    before = metric_totals(cluster)
    api.completions.create(model="tiny", prompt="lazy dogs", max_tokens=3, temperature=0)
    assert wait_metric_increase(cluster, "pdserve:local_prefills_total", before, 1) >= 1
    assert metric_totals(cluster).get("pdserve:kv_transfers_total", 0) == before.get("pdserve:kv_transfers_total", 0)
    wait_all_blocks_free(cluster)
