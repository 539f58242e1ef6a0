"""Multi-LoRA serving against transformers + peft, offline and through a disaggregated cluster.

Three adapters written by the ``peft`` library on the tiny checkpoint (random, non-zero
A and B: ``init_lora_weights=False``), of different ranks, target modules and scalings
(one uses rsLoRA), run in the same batches as the base model. Greedy tokens must equal
``PeftModel.generate``'s for every (adapter, prompt) pair.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil

import httpx
import peft
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pdserve.common.protocol import LoRARequest, SamplingParams
from pdserve.common.utils import free_port
from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from pdserve.llm import LLM
from pdserve.engine.lora.adapter import LoRAAdapterError, load_adapter
from pdserve.engine.scheduling.request import Request

ADAPTERS = {  # name -> LoraConfig arguments
    "alpha": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "beta": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True),
    "gamma": dict(r=16, lora_alpha=32, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}
PROMPTS = [[3 + (7 * i + 5 * j) % 1900 for j in range(20 + 2 * i)] for i in range(5)]  # 20..28 tokens: > 1 block
NUM_TOKENS = 10


@pytest.fixture(scope="module")
def adapter_dirs(model_dir, tmp_path_factory):
    """name -> PEFT adapter directory, written by peft itself."""
    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for seed, (name, kwargs) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **kwargs))
        model.save_pretrained(str(root / name))
        dirs[name] = str(root / name)
    return dirs


@pytest.fixture(scope="module")
def reference(model_dir, adapter_dirs):
    """(adapter name or None, prompt index) -> greedy tokens of transformers (+ peft)."""
    out = {}
    for name in [None, *ADAPTERS]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, adapter_dirs[name])
        model.eval()
        for k, prompt in enumerate(PROMPTS):
            with torch.no_grad():
                ids = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
            out[(name, k)] = ids[0, len(prompt):].tolist()
    return out


def test_adapters_change_the_output(reference):
    """Guards the tests below: an adapter that did nothing would pass them trivially."""
    for name in ADAPTERS:
        assert sum(reference[(name, k)] != reference[(None, k)] for k in range(len(PROMPTS))) >= 3, name


def test_llm_mixed_batch_matches_peft(model_dir, adapter_dirs, reference):
    """Three adapters and the base model in one generate call, two LoRA slots (so adapters wait
    and take turns in the slots), the same prompts under every adapter (the prefix cache must
    keep their KV apart), token-exact against peft."""
    loras = {name: LoRARequest(lora_name=name, lora_int_id=i + 1, lora_path=path)
             for i, (name, path) in enumerate(adapter_dirs.items())}
    with LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_memory="4MiB") as llm:
        keys = [(name, k) for name in [None, *ADAPTERS] for k in range(len(PROMPTS))]
        outputs = llm.generate([PROMPTS[k] for _, k in keys], SamplingParams(max_tokens=NUM_TOKENS, temperature=0,
                                                                             ignore_eos=True),
                               lora_request=[loras.get(name) for name, _ in keys], use_tqdm=False)
        for key, output in zip(keys, outputs):
            assert output.outputs[0].token_ids == reference[key], key
        # Each adapter's blocks are cached under its own root: a repeat hits only its own.
        hits = llm.core.scheduler.stats.prefix_cache_hits
        again = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True),
                             lora_request=loras["beta"], use_tqdm=False)
        assert again[0].outputs[0].token_ids == reference[("beta", 0)]
        assert llm.core.scheduler.stats.prefix_cache_hits - hits == 16  # its one full prompt block
        assert llm.core.block_manager.num_free_blocks == llm.core.runner.num_blocks  # nothing leaked


def test_prefix_cache_keeps_adapters_apart(model_dir):
    """The same tokens under two adapters (or an adapter and the base) hash to different blocks."""
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(12))
    base = Request("r0", tokens, SamplingParams())
    lora_a = Request("r1", tokens, SamplingParams(), lora=LoRARequest(lora_name="a", lora_int_id=1, lora_path="/a"))
    lora_b = Request("r2", tokens, SamplingParams(), lora=LoRARequest(lora_name="b", lora_int_id=2, lora_path="/b"))
    assert len({base.cache_root, lora_a.cache_root, lora_b.cache_root}) == 3
    parent = lora_a.cache_root
    for block_id, start in enumerate(range(0, 12, 4)):
        parent = bm.cache_block(block_id, parent, tokens[start:start + 4])
    assert len(bm.find_cached_prefix(tokens, 12, lora_a.cache_root)[0]) == 3
    assert bm.find_cached_prefix(tokens, 12, lora_b.cache_root)[0] == []
    assert bm.find_cached_prefix(tokens, 12, base.cache_root)[0] == []


def test_bad_adapters_are_refused_with_the_reason(model_dir, adapter_dirs, tmp_path):
    hf_config = AutoConfig.from_pretrained(model_dir)
    with pytest.raises(LoRAAdapterError, match="rank 16 > --max-lora-rank 8"):
        load_adapter("gamma", adapter_dirs["gamma"], hf_config, max_lora_rank=8)
    with pytest.raises(LoRAAdapterError, match="not a directory"):
        load_adapter("x", str(tmp_path / "missing"), hf_config, 16)
    dora = tmp_path / "dora"
    shutil.copytree(adapter_dirs["alpha"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoRAAdapterError, match="DoRA"):
        load_adapter("dora", str(dora), hf_config, 16)
    other = AutoConfig.from_pretrained(model_dir)
    other.hidden_size = 128  # an adapter trained on another model
    with pytest.raises(LoRAAdapterError, match="another model"):
        load_adapter("alpha", adapter_dirs["alpha"], other, 16)
    with LLM(model_dir, kv_cache_memory="1MiB") as llm:  # LoRA not enabled
        with pytest.raises(ValueError, match="--enable-lora"):
            llm.generate([PROMPTS[0]], lora_request=LoRARequest(lora_name="alpha", lora_int_id=1,
                                                                lora_path=adapter_dirs["alpha"]), use_tqdm=False)
        assert not llm.core.has_unfinished()


@pytest.mark.cluster
def test_disaggregated_cluster_serves_mixed_adapters(model_dir, adapter_dirs, reference, tmp_path):
    """1 prefill + 1 decode worker: two adapters from --lora-modules, the third loaded at runtime
    (behind the API key), all four models concurrently, token-exact against peft; then the
    runtime adapter is unloaded and is a 404."""
    key = "sk-lora-test"
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       api_key=key, router_args=["--enable-lora", "--lora-modules",
                                                 f"alpha={adapter_dirs['alpha']}", f"beta={adapter_dirs['beta']}"],
                       worker_args=["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                                    "--remote-prefill-threshold", "4", "--kv-cache-memory", "4MiB"])
    auth = {"Authorization": f"Bearer {key}"}
    with LocalCluster(spec, log_dir=str(tmp_path / "logs")) as cluster:
        url = cluster.url
        base_name = os.path.basename(model_dir)
        models = httpx.get(f"{url}/v1/models", headers=auth, timeout=10).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [(base_name, None), ("alpha", base_name),
                                                                 ("beta", base_name)]
        body = {"lora_name": "gamma", "lora_path": adapter_dirs["gamma"]}
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=30).status_code == 401
        r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        again = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth, timeout=30)
        assert again.status_code == 400 and "already" in again.json()["error"]["message"]
        bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)},
                         headers=auth, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"

        def complete(name, k):
            r = httpx.post(f"{url}/v1/completions", headers=auth, timeout=120, json={
                "model": name or base_name, "prompt": PROMPTS[k], "max_tokens": NUM_TOKENS, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        keys = [(name, k) for k in range(len(PROMPTS)) for name in [None, *ADAPTERS]]
        with cf.ThreadPoolExecutor(8) as pool:
            texts = dict(zip(keys, pool.map(lambda nk: complete(*nk), keys)))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        for key_ in keys:
            assert texts[key_] == tokenizer.decode(reference[key_], skip_special_tokens=True), key_

        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        info = [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")]
        assert len(info) == 2 and all('max_lora="2"' in line for line in info), info  # prefill and decode

        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "gamma"}, headers=auth, timeout=10)
        assert r.status_code == 200, r.text
        gone = httpx.post(f"{url}/v1/completions", headers=auth, timeout=30,
                          json={"model": "gamma", "prompt": PROMPTS[0], "max_tokens": 2})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == 404
        missing = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "gamma"}, headers=auth, timeout=10)
        assert missing.status_code == 404
        assert "gamma" not in [m["id"] for m in httpx.get(f"{url}/v1/models", headers=auth, timeout=10).json()["data"]]


def test_tensor_parallel_adapters_match_peft(model_dir, adapter_dirs, reference):
    """TP 2: each rank holds its shard of every slot (A whole and B's rows in column-parallel
    layers, A's columns in row-parallel ones, whose term joins the all-reduce)."""
    loras = [None, *(LoRARequest(lora_name=name, lora_int_id=i + 1, lora_path=path)
                     for i, (name, path) in enumerate(adapter_dirs.items()))]
    with LLM(model_dir, enable_lora=True, max_loras=3, tensor_parallel_size=2, kv_cache_memory="2MiB") as llm:
        outputs = llm.generate([PROMPTS[1]] * 4, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True),
                               lora_request=loras, use_tqdm=False)
    for lora, output in zip(loras, outputs):
        name = lora.lora_name if lora is not None else None
        assert output.outputs[0].token_ids == reference[(name, 1)], name


def test_beam_search_with_an_adapter_matches_peft(model_dir, adapter_dirs):
    """LLM.beam_search(lora_request=...) keeps the same hypotheses as peft's beam search."""
    from pdserve.beam_search import BeamSearchParams

    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                           adapter_dirs["beta"]).eval()
    prompt = PROMPTS[2]
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, max_new_tokens=6,
                             do_sample=False, early_stopping=False, eos_token_id=None, pad_token_id=0)
    expected = sorted(seq[len(prompt):].tolist() for seq in ref)
    lora = LoRARequest(lora_name="beta", lora_int_id=1, lora_path=adapter_dirs["beta"])
    with LLM(model_dir, enable_lora=True, kv_cache_memory="2MiB") as llm:
        out = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True),
                              lora_request=lora)
    assert sorted(s.tokens[len(prompt):] for s in out[0].sequences) == expected


def test_prefix_aware_routing_keys_each_adapter_apart():
    """An adapter's prompts key the prefix-aware ring on their own (their KV is cached apart), so the
    same prompt under different adapters spreads over the workers instead of piling on one."""
    from pdserve.engine.scheduling.request import lora_cache_root
    from pdserve.router.routing import prefix_key

    prompt = list(range(100, 164))
    roots = [b""] + [lora_cache_root(LoRARequest(lora_name=f"a{i}", lora_int_id=i, lora_path=f"/a{i}"))
                     for i in range(1, 9)]
    keys = {prefix_key(prompt, 16, 4, root) for root in roots}
    assert len(keys) == len(roots)
    assert prefix_key(prompt, 16, 4, roots[1]) == prefix_key(prompt + [7], 16, 4, roots[1])  # still a prefix key


def test_step_mapping_groups_each_adapters_rows_and_the_layer_adds_only_its_own_term():
    """Runs of one slot merge into a slice; a slot whose sequences are apart gets row indices;
    base-model and empty sequences belong to no group. Each row of a layer's output gets exactly
    its own adapter's x A^T B (base rows nothing), against a dense per-row reference."""
    from pdserve.engine.layers.base import ColumnParallelLinear
    from pdserve.engine.lora.layers import LoRAContext, LoRASlots, LoRAStepMapping

    seq_slots = [1, 1, -1, 0, 1, 2, 2, 0]
    query_start_loc = [0, 3, 4, 6, 7, 7, 8, 9, 10]  # sequence 4 (slot 1) has no tokens this step
    mapping = LoRAStepMapping(seq_slots, query_start_loc)
    groups = {slot: rows for slot, rows in mapping.groups}
    assert [slot for slot, _ in mapping.groups] == [0, 1, 2]
    assert groups[1] == slice(0, 4) and groups[2] == slice(7, 9)  # seqs 0-1 merged; seqs 5-6 adjacent
    assert groups[0].tolist() == [6, 9]  # seqs 3 and 7: apart

    g = torch.Generator().manual_seed(0)
    linear = ColumnParallelLinear(16, [8, 4, 4])  # three fused parts, like qkv_proj
    context = LoRAContext()
    slots = LoRASlots(linear, num_slots=3, max_rank=2, context=context)
    adapters = {s: {p: (torch.randn(2 if s else 1, 16, generator=g), torch.randn(n, 2 if s else 1, generator=g))
                    for p, n in enumerate([8, 4, 4])} for s in range(3)}
    for s, parts in adapters.items():
        slots.set_slot(s, parts)
    x, y = torch.randn(10, 16, generator=g), torch.randn(10, 16, generator=g)
    context.mapping = mapping
    got = slots.add_to(x, y.clone())
    row_slot = [1, 1, 1, 1, None, None, 0, 2, 2, 0]
    for row, s in enumerate(row_slot):
        want = y[row].clone()
        if s is not None:
            want += torch.cat([(x[row] @ a.t()) @ b.t() for a, b in adapters[s].values()])
        torch.testing.assert_close(got[row], want)
    context.mapping = None
    assert slots.add_to(x, y) is y  # no adapter in the step: nothing added
