"""The families beyond Llama through the engine and the cluster, against transformers.

Each checkpoint is written here by transformers itself (random weights, norms and biases
perturbed so they matter) with the tiny model's tokenizer, so the router can serve it.
tests/test_model.py checks each family's forward layer by layer; here they run as users
run them: ``LLM`` with chunked prefill, prefix caching and preemption under a small KV
budget, the compiled decode step, and a disaggregated 1P+1D cluster.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve import LLM, SamplingParams
from pdserve.common.utils import free_port
from pdserve.kernels import load_paged_attention
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from tests.checkpoints import FAMILIES, PROMPTS, greedy_reference, write_checkpoint

@pytest.fixture(scope="module")
def family_dirs(model_dir, tmp_path_factory) -> dict[str, str]:
    return {name: write_checkpoint(make_config(), tmp_path_factory.mktemp(name), model_dir)
            for name, make_config in FAMILIES.items()}


def hf_reference(model_path: str, prompt_ids: list[list[int]], max_tokens: int):
    """transformers' greedy tokens and each chosen token's logprob, per prompt."""
    return greedy_reference(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval(),
                            prompt_ids, max_tokens)


def _block_bytes(cfg, block_size: int = 16, element_size: int = 4) -> int:
    """What one block of 16 tokens takes over all layers, from the config alone (float32)."""
    if getattr(cfg, "kv_lora_rank", None):  # MLA: one latent row (plus the rope key) per token, no V slot
        slots, kv_heads, head_dim = 1, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    else:
        slots, kv_heads = 2, cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * slots * block_size * kv_heads * head_dim * element_size


@pytest.mark.parametrize("family", list(FAMILIES))
def test_llm_greedy_tokens_and_logprobs_match_transformers(family, family_dirs):
    """Chunked prefill (16-token steps), prefix caching and a KV budget of 8 blocks of 16 tokens
    for three requests of up to 4 blocks each, so they preempt each other: still transformers'
    tokens and logprobs. Gemma 3 and gpt-oss free their sliding layers' blocks as the window moves
    (KV cache groups), so 8 blocks' bytes hold all three: they get 6."""
    path = family_dirs[family]
    tok = AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0, ignore_eos=True)
    ref = hf_reference(path, prompt_ids, params.max_tokens)
    block_bytes = _block_bytes(FAMILIES[family]())
    budget = 6 if family in ("gemma3", "gpt_oss") else 8
    llm = LLM(path, max_num_batched_tokens=16, enable_prefix_caching=True, kv_cache_memory=budget * block_bytes)
    try:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        assert llm.core.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    finally:
        llm.close()
    for (want_tokens, want_logprobs), out in zip(ref, outputs):
        got = out.outputs[0]
        assert got.token_ids == want_tokens
        assert max(abs(g.logprob - w) for g, w in zip(got.logprobs, want_logprobs)) < 1e-4


@pytest.mark.skipif(load_paged_attention() is None, reason="no C++ compiler: nothing is compiled")
@pytest.mark.parametrize("family", ["qwen3_moe", "gemma3", "deepseek_v3", "gpt_oss"])
def test_compiled_decode_step_gives_the_eager_tokens(family, family_dirs):
    """The compiled step is one graph (MoE experts and attention are opaque operators, not graph
    breaks), stays compiled however many models this process has compiled before, and gives the
    eager step's tokens."""
    import torch._dynamo.utils

    path = family_dirs[family]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [list(range(5, 30)), [7, 300, 41, 9]]
    tokens = {}
    for eager in (True, False):
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        llm = LLM(path, enforce_eager=eager)
        try:
            assert (llm.core.runner._compiled_decode is None) == eager
            tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.close()
        assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks, \
            dict(torch._dynamo.utils.counters["graph_break"])
    assert tokens[False] == tokens[True]


def test_expert_parallel_llm_gives_transformers_tokens(family_dirs):
    """TP 2 attention with the experts split whole over the two ranks (--enable-expert-parallel)."""
    path = family_dirs["qwen3_moe"]
    tok = AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    ref = hf_reference(path, prompt_ids, 12)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, kv_cache_memory="2MiB") as llm:
        experts = llm.core.runner.model.model.layers[0].mlp.experts  # the driver rank's
        assert experts.expert_parallel and experts.num_local_experts == 2
        outputs = llm.generate(prompt_ids, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [want for want, _ in ref]


@pytest.mark.cluster
@pytest.mark.parametrize("family,prefill_tp", [("qwen3_moe", 2), ("deepseek_v3", 2)])
def test_disaggregated_cluster_serves_transformers_tokens(family, prefill_tp, family_dirs, tmp_path):
    """1P+1D, the prefill worker TP 2 with expert parallelism and the decode worker TP 1 (the KV is
    re-laid between the two layouts; DeepSeek's MLA latent is replicated on the prefill ranks and
    arrives once): the prefill worker builds the KV of every prompt longer than 8 tokens and ships
    it; the tokens are transformers'."""
    path = family_dirs[family]
    spec = ClusterSpec(model=path, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       prefill_tensor_parallel_size=prefill_tp,
                       worker_args=["--remote-prefill-threshold", "8", "--kv-cache-memory", "4MiB",
                                    "--enable-expert-parallel"])
    tok = AutoTokenizer.from_pretrained(path)
    ref = hf_reference(path, [tok(p).input_ids for p in PROMPTS], 12)
    with LocalCluster(spec, log_dir=str(tmp_path / "logs")) as cluster:
        api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)
        model = api.models.list().data[0].id
        for prompt, (want, _) in zip(PROMPTS, ref):
            choice = api.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0]
            assert choice.text == tok.decode(want, skip_special_tokens=True)
        workers = httpx.get(f"{cluster.url}/workers", timeout=10).json()
        prefill = [w for w in workers if w["role"] == "prefill"]
        assert prefill and prefill[0]["num_routed"] >= len(PROMPTS)  # every prompt was prefilled remotely


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_moe_experts_give_a_token_the_same_bits_however_many_share_its_expert(batch_invariant):
    """Every token routed to expert 0 (weight 1): a probe token's output among M others. Batch-
    invariant, one bit pattern for every M; without it, MKL's M-dependent kernels give several
    (the check that this test can fail)."""
    from pdserve.engine.models.moe import FusedExperts
    from tests.helpers.kernels import _distinct_rows

    experts = FusedExperts(num_experts=2, hidden_size=256, intermediate_size=320, tp_group=None,
                           dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(2)
    experts.w13_weight.data.normal_(generator=gen)
    experts.w2_weight.data.normal_(generator=gen)
    experts.batch_invariant = batch_invariant

    def run(x):
        n = x.shape[0]
        return experts(x, torch.zeros(n, 1, dtype=torch.int64), torch.ones(n, 1))

    distinct = _distinct_rows(run, 256)
    assert distinct == 1 if batch_invariant else distinct > 1


def test_moe_request_is_bit_identical_among_any_traffic(family_dirs):
    """``--batch-invariant`` covers the routed experts: however many other tokens pick the same
    experts, the target request's completion and logprobs are the same bits."""
    from tests.helpers.kernels import _runs

    with LLM(family_dirs["qwen3_moe"], batch_invariant=True, enable_prefix_caching=False, seed=0,
             num_threads=1) as llm:
        experts = llm.core.runner.model.model.layers[0].mlp.experts
        assert experts.batch_invariant
        results = _runs(llm, 12, seed=5)
    assert len(set(results)) == 1


@pytest.mark.parametrize("command", [["up"], ["decode", "--router", "tcp://127.0.0.1:1"]])
def test_an_unsupported_architecture_is_one_line_before_anything_starts(command, tmp_path):
    import json
    import subprocess
    import sys

    from pdserve.engine.models import SUPPORTED_MODEL_TYPES

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    proc = subprocess.run([sys.executable, "-m", "pdserve", *command, "--model", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unsupported architecture" in lines[0] and "GPT2LMHeadModel" in lines[0], lines
    assert "Traceback" not in proc.stderr and all(t in lines[0] for t in SUPPORTED_MODEL_TYPES)


def test_pipeline_parallel_and_speculative_decoding_give_transformers_tokens(family_dirs):
    """A MoE model in two pipeline stages, n-gram speculative decoding on Gemma 3's windows, and a
    DeepSeek draft model (its own one-slot latent cache) for a DeepSeek target."""
    repetitive = "a b c d a b c d a b c d a b c d a b"
    for family, kwargs in (("qwen3_moe", dict(pipeline_parallel_size=2)),
                           ("gemma3", dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                                                              '"prompt_lookup_max": 3}')),
                           ("deepseek_v3", dict(speculative_config=json.dumps(  # a draft with a latent cache
                               {"method": "draft_model", "model": family_dirs["deepseek_v3"],
                                "num_speculative_tokens": 2})))):
        path = family_dirs[family]
        tok = AutoTokenizer.from_pretrained(path)
        prompt_ids = [tok(p).input_ids for p in [*PROMPTS, repetitive]]
        ref = hf_reference(path, prompt_ids, 16)
        with LLM(path, kv_cache_memory="2MiB", **kwargs) as llm:
            outputs = llm.generate(prompt_ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                                   use_tqdm=False)
            stats = llm.core.scheduler.stats
            if "speculative_config" in kwargs:
                assert stats.spec_decode_num_draft_tokens > 0
        assert [o.outputs[0].token_ids for o in outputs] == [want for want, _ in ref], family


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_lora_on_the_attention_projections_matches_peft(family, family_dirs, tmp_path):
    """A peft adapter on q/k/v/o (Qwen3's q/k norms sit between the projection and RoPE; the MoE
    model's experts stay base weights): token-exact against transformers + peft."""
    import peft

    from pdserve.common.protocol import LoRARequest

    path = family_dirs[family]
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    adapter = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, r=8, lora_alpha=16,
                                                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    adapter.save_pretrained(str(tmp_path / "adapter"))
    tok = AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    ref_model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                               str(tmp_path / "adapter")).eval()
    want = []
    for ids in prompt_ids:
        with torch.no_grad():
            out = ref_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)
        want.append(out[0, len(ids):].tolist())
    base_tokens = [want_ for want_, _ in hf_reference(path, prompt_ids, 12)]
    assert want != base_tokens  # the adapter changes the output: the comparison below means something
    lora = LoRARequest(lora_name="attn", lora_int_id=1, lora_path=str(tmp_path / "adapter"))
    with LLM(path, enable_lora=True, max_lora_rank=8, kv_cache_memory="2MiB") as llm:
        outputs = llm.generate(prompt_ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                               lora_request=lora, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want


def test_deepseek_caches_one_latent_row_per_token(family_dirs):
    """MLA's cache is the latent alone: (kv_lora_rank + qk_rope_head_dim) values per token and layer,
    no V slot, so a fixed --kv-cache-memory holds twice the blocks a K/V cache of the same rows did."""
    cfg = FAMILIES["deepseek_v3"]()
    per_token_layer = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4  # float32: 160 bytes
    budget = 8 * 2 * 16 * cfg.num_hidden_layers * per_token_layer  # 8 blocks of the old K+V layout
    with LLM(family_dirs["deepseek_v3"], kv_cache_memory=budget, enforce_eager=True) as llm:
        runner = llm.core.runner
        cache = runner.kv_cache
        assert (runner.kv_slots, runner.kv_v_dim) == (1, cfg.kv_lora_rank)
        assert cache.shape == (cfg.num_hidden_layers, 1, 16, 16, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        assert cache.nbytes // (cfg.num_hidden_layers * runner.num_blocks * runner.block_size) == per_token_layer
        assert runner.num_blocks == 16 and runner.kv_cache_bytes == budget  # 2x the 8 it was
        out = llm.generate([list(range(5, 40))], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    with LLM(family_dirs["qwen3"], kv_cache_memory="1MiB", enforce_eager=True) as llm:  # K/V families: 2 slots
        assert llm.core.runner.kv_slots == 2 and llm.core.runner.kv_cache.shape[1] == 2


def test_deepseek_int8_cache_agrees_with_float32_and_bounds_the_logit_error(family_dirs):
    """As tests/test_kv_quant.py does for Llama: an int8 latent cache (one scale per latent row, the
    values read with the key row's scale) mostly gives float32's tokens, with a logit error that is
    small on average and below fp8's. This tiny random DeepSeek has a logit spread of ~5.5 (Llama's
    ~60) and near-ties (median top-2 gap 0.13), so the bounds are on agreement and mean error; measured:
    next token 92% as float32's, mean |error| 0.025 (fp8 0.054) against a logit std of 0.80, the same
    as the earlier cache with a separate V row."""
    from tests.helpers.kernels import kv_dtype_runs

    def check(runner):
        assert (runner.kv_cache.dtype, runner.kv_cache.shape[1], runner.kv_cache.shape[-1]) == \
            (torch.uint8, 1, runner.head_dim + 4)

    prompts, base, int8, by_dtype = kv_dtype_runs(family_dirs["deepseek_v3"], check)
    ref, logits, fp8 = by_dtype["float32"], by_dtype["int8"], by_dtype["fp8_e4m3"]
    assert sum(a == b for a, b in zip(base, int8)) >= len(prompts) // 3, (base, int8)
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85
    errors = {"int8": (logits - ref).abs().mean().item(), "fp8_e4m3": (fp8 - ref).abs().mean().item()}
    assert 0 < errors["int8"] < 0.06 * ref.std().item(), errors  # quantized, yet close
    assert errors["int8"] < errors["fp8_e4m3"], errors  # 7 bits beat 3


def test_every_family_implements_the_model_interface(family_dirs, model_dir):
    """``load_model`` returns a ``CausalLM`` for every family (the protocol the runner, the compiled step, the
    loader and LoRA use), with the cache-sizing attributes as the checkpoint's config gives them."""
    from transformers import AutoConfig

    from pdserve.engine.models.interface import CausalLM
    from pdserve.engine.models.loader import load_model

    for name, path in {"llama": model_dir, **family_dirs}.items():
        model = load_model(path, dtype=torch.float32, device="cpu")
        cfg = AutoConfig.from_pretrained(path)
        assert isinstance(model, CausalLM), name
        assert model.layer_range == (0, cfg.num_hidden_layers) and model.num_layers == cfg.num_hidden_layers, name
        assert model.vocab_size == cfg.vocab_size and model.kv_slots in (1, 2), name
        assert len(model.decoder_layers) == cfg.num_hidden_layers, name
        hidden = model.embed(torch.tensor([1, 2, 3]))
        assert hidden.shape == (3, cfg.hidden_size), name
