"""Our model families against the Hugging Face reference on small random checkpoints."""

import json
import os
import random

import pytest
import torch
from safetensors.torch import save_file
from transformers import (AutoModelForCausalLM, DeepseekV3Config, Gemma3TextConfig, GptOssConfig, LlamaConfig,
                          MistralConfig, MixtralConfig, Olmo2Config, Phi3Config, Qwen2Config, Qwen3Config,
                          Qwen3MoeConfig)

from pdserve.engine.layers.attention import AttentionMetadata
from pdserve.engine.models.loader import load_model
from pdserve.engine.models import SUPPORTED_MODEL_TYPES, UnsupportedArchitecture

BLOCK_SIZE = 4
NUM_BLOCKS = 40
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=500,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
)

CONFIGS = {
    "llama_untied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False, rope_theta=500.0),
    "llama_tied_bias": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "qwen2_tied": lambda: Qwen2Config(**{**COMMON, "num_hidden_layers": 3}, tie_word_embeddings=True),
    "qwen2_untied": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False),
    "mistral_window": lambda: MistralConfig(**COMMON, sliding_window=6),
    # Qwen3: per-head q/k RMSNorm; head_dim 24 makes q (4 x 24 = 96) wider than hidden (64).
    "qwen3_tied": lambda: Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=True),
    "qwen3_bias": lambda: Qwen3Config(**COMMON, attention_bias=True, tie_word_embeddings=False),
    # Phi-3: the checkpoint's fused qkv_proj / gate_up_proj; a window on every layer; partial rotary.
    "phi3": lambda: Phi3Config(**COMMON, tie_word_embeddings=False),
    "phi3_window_partial_rope": lambda: Phi3Config(**COMMON, sliding_window=6, partial_rotary_factor=0.5,
                                                   tie_word_embeddings=False),
    # Qwen3-MoE: 4 experts, top 2; layer 1 dense by decoder_sparse_step, layer 2 by mlp_only_layers.
    "qwen3_moe": lambda: Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 4}, moe_intermediate_size=32,
                                        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                        decoder_sparse_step=1, mlp_only_layers=[2], tie_word_embeddings=False),
    "qwen3_moe_sparse_step": lambda: Qwen3MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=4,
                                                    num_experts_per_tok=3, norm_topk_prob=False,
                                                    decoder_sparse_step=2, tie_word_embeddings=False),
    "mixtral": lambda: MixtralConfig(**{**COMMON, "intermediate_size": 48}, num_local_experts=4,
                                     num_experts_per_tok=2, tie_word_embeddings=False),
    # OLMo 2: post-norm blocks, q/k norms over all heads (sharded under TP).
    "olmo2": lambda: Olmo2Config(**COMMON, tie_word_embeddings=False),
    "olmo2_one_kv_head": lambda: Olmo2Config(**{**COMMON, "num_key_value_heads": 1}, tie_word_embeddings=True),
    # Gemma 3: sliding (window 6) and global layers with their own RoPE (global: linear scaling),
    # (1 + w) norms, four norms a block, q/k norms, embedding scale, query_pre_attn_scalar; soft cap.
    "gemma3": lambda: Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 3}, head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}),
    "gemma3_softcap": lambda: Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                                               final_logit_softcapping=3.0, tie_word_embeddings=False),
    # YaRN: the long-context scaling of Qwen3, DeepSeek and gpt-oss checkpoints (a short original context
    # so the ramp between interpolated and kept frequencies falls inside the head).
    "qwen3_yarn": lambda: Qwen3Config(**COMMON, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 64}),
    # DeepSeek-V3: MLA (q LoRA or not, interleaved rope, v_head_dim != qk head dim), group-limited
    # sigmoid routing with a correction bias, shared experts, first layer dense; YaRN with mscale.
    "deepseek_v3": lambda: DeepseekV3Config(
        **{**COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4}, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, n_group=4, topk_group=2,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=12, routed_scaling_factor=2.5, tie_word_embeddings=False),
    "deepseek_v3_no_q_lora_yarn": lambda: DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=2,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, norm_topk_prob=False, rope_interleave=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                      "mscale_all_dim": 1.0}, tie_word_embeddings=False),
    # gpt-oss: sinks, biases everywhere, alternating windows (6) and full layers, YaRN (not truncated),
    # biased router softmaxing its top-k logits, clamped SwiGLU experts stored fused and interleaved.
    "gpt_oss": lambda: GptOssConfig(**{**COMMON, "intermediate_size": 32}, head_dim=16, sliding_window=6,
                                    num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.0,
                                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0,
                                                     "original_max_position_embeddings": 64}),
    "llama3_rope": lambda: LlamaConfig(
        **COMMON,
        rope_scaling={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        },
    ),
}


def make_checkpoint(name, tmp_path):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).eval()
    with torch.no_grad():  # norms and biases default to ones/zeros: randomize so they are tested too
        for pname, p in hf.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
        for bname, b in hf.named_buffers():  # DeepSeek's router bias is a buffer: make it steer the choice
            if bname.endswith("e_score_correction_bias"):
                b.add_(0.5 * torch.randn_like(b))
    hf.save_pretrained(tmp_path)
    return hf


def new_cache(model, dtype=torch.float32):
    shape = (model.num_layers, model.kv_slots, NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    return torch.full(shape, float("nan"), dtype=dtype)


class PagedSeq:
    """One sequence's block table over shuffled, non-contiguous block ids."""

    def __init__(self, seed=0):
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.table, self.num_computed = [], 0

    def step(self, model, kv_cache, token_ids):
        """Run token_ids as the next chunk; returns logits [len(token_ids), vocab]."""
        n = len(token_ids)
        while len(self.table) * BLOCK_SIZE < self.num_computed + n:
            self.table.append(self.free.pop())
        meta = AttentionMetadata.build([self.table], [self.num_computed], [n], BLOCK_SIZE)
        positions = torch.arange(self.num_computed, self.num_computed + n)
        hidden = model(torch.tensor(token_ids), positions, kv_cache, meta)
        self.num_computed += n
        return model.compute_logits(hidden)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_hf(name, tmp_path):
    hf = make_checkpoint(name, tmp_path)
    model = load_model(str(tmp_path), torch.float32, "cpu")
    prompt = torch.randint(2, 500, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert ref.std() > 0.1, "random weights too small to make a meaningful comparison"

    # One prefill.
    logits = PagedSeq().step(model, new_cache(model), prompt)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)

    # Chunked prefill: the second chunk attends to the cached first chunk.
    seq, cache = PagedSeq(seed=1), new_cache(model)
    chunked = torch.cat([seq.step(model, cache, prompt[:6]), seq.step(model, cache, prompt[6:])])
    torch.testing.assert_close(chunked, ref, atol=1e-4, rtol=1e-4)

    # Greedy decode through the paged cache equals HF generate.
    num_new = 20
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False)[0, len(prompt):]
    seq, cache = PagedSeq(seed=2), new_cache(model)
    out = []
    logits = seq.step(model, cache, prompt)
    for _ in range(num_new):
        out.append(int(logits[-1].argmax()))
        logits = seq.step(model, cache, [out[-1]])
    assert out == expected.tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_last_layer_runs_only_the_rows_asked_for(name, tmp_path):
    """``out_rows``: past attention the last layer runs on those rows alone (its feed-forward sees 3
    of 13 rows), their logits are transformers', and the cache holds every row's K/V as without it."""
    hf = make_checkpoint(name, tmp_path)
    model = load_model(str(tmp_path), torch.float32, "cpu")
    prompt = torch.randint(2, 500, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    rows = torch.tensor([12, 3, 7])
    meta = AttentionMetadata.build([[5, 2, 9, 0]], [0], [len(prompt)], BLOCK_SIZE)
    ffn_rows = []
    model.model.layers[-1].mlp.register_forward_hook(lambda module, args, out: ffn_rows.append(args[0].shape[0]))
    full_cache, cache = new_cache(model), new_cache(model)
    model(torch.tensor(prompt), torch.arange(len(prompt)), full_cache, meta)
    hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), cache, meta, out_rows=rows)
    assert ffn_rows == [len(prompt), 3]
    torch.testing.assert_close(model.compute_logits(hidden), ref[rows], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache, full_cache, atol=0, rtol=0, equal_nan=True)


def test_batched_decode_mixed_with_prefill(tmp_path):
    """Two sequences in one forward (one decoding, one prefilling) equal running them alone."""
    make_checkpoint("qwen2_untied", tmp_path)
    model = load_model(str(tmp_path), torch.float32, "cpu")
    a, b = list(range(3, 14)), list(range(40, 47))
    cache = new_cache(model)
    solo_a = PagedSeq(seed=3).step(model, new_cache(model), a)
    solo_b = PagedSeq(seed=4).step(model, new_cache(model), b)
    # Cache all of a but its last token, then run a's last token with all of b.
    table_a, table_b = [0, 7, 3], [5, 9]
    model(torch.tensor(a[:-1]), torch.arange(10), cache, AttentionMetadata.build([table_a], [0], [10], BLOCK_SIZE))
    meta = AttentionMetadata.build([table_a, table_b], [10, 0], [1, 7], BLOCK_SIZE)
    positions = torch.cat([torch.tensor([10]), torch.arange(7)])
    logits = model.compute_logits(model(torch.tensor([a[-1]] + b), positions, cache, meta))
    torch.testing.assert_close(logits[0], solo_a[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1:], solo_b, atol=1e-4, rtol=1e-4)


def test_on_layer_done_and_bfloat16(tmp_path):
    hf = make_checkpoint("llama_untied", tmp_path)
    model = load_model(str(tmp_path), torch.bfloat16, "cpu")
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    prompt = list(range(5, 17))
    done = []
    cache = new_cache(model, torch.bfloat16)
    meta = AttentionMetadata.build([[3, 1, 8]], [0], [len(prompt)], BLOCK_SIZE)
    hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), cache, meta, on_layer_done=done.append)
    assert done == list(range(model.num_layers))
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (logits - ref).abs().max() < 0.1 * ref.abs().max()


def test_unsupported_model_type_raises(tmp_path):
    cfg = LlamaConfig(**COMMON).to_dict()
    cfg["model_type"] = "gpt2"
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="unsupported architecture") as info:
        load_model(str(tmp_path), torch.float32, "cpu")
    message = str(info.value)
    assert "\n" not in message and "GPT2LMHeadModel" in message
    assert all(t in message for t in SUPPORTED_MODEL_TYPES)


def test_an_unsupported_checkpoint_quantization_is_refused_by_name(tmp_path):
    make_checkpoint("gpt_oss", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq"}  # mxfp4 loads (tests/test_mxfp4.py); AWQ does not
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quant_method='awq' is not supported"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_the_checkpoint_fixture_writes_the_family_it_names(tmp_path):
    """Each config above really is its family (the comparisons would be vacuous otherwise)."""
    from pdserve.engine.models.moe import SparseMoeBlock

    for name, family in (("qwen3_tied", "qwen3"), ("phi3", "phi3"), ("qwen3_moe", "qwen3_moe"), ("mixtral", "mixtral")):
        make_checkpoint(name, tmp_path / name)
        model = load_model(str(tmp_path / name), torch.float32, "cpu")
        assert model.config.model_type == family
        if "moe" in name:  # layer 2 is dense by mlp_only_layers, the others sparse
            assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == [True, True, False, True]
    assert type(model).__name__ == "MixtralForCausalLM"


def test_moe_routes_tokens_to_different_experts(tmp_path):
    """The comparison with HF is only meaningful if tokens really spread over the experts."""
    make_checkpoint("mixtral", tmp_path)
    model = load_model(str(tmp_path), torch.float32, "cpu")
    block = model.model.layers[0].mlp
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    ids = torch.topk(torch.softmax(x @ block.gate.weight.T, -1), 2, dim=-1).indices
    assert len(torch.unique(ids)) == 4
    # one expert's output equals the dense SwiGLU with its weights, on the tokens routed to it
    picked = (ids == 0).any(dim=1)
    w = torch.where(ids == 0, 1.0, 0.0).sum(1, keepdim=True)
    only_0 = block.experts(x, torch.zeros_like(ids), torch.where(ids == 0, 1.0, 0.0))
    w13, w2 = block.experts.w13_weight[0], block.experts.w2_weight[0]
    gate, up = (x @ w13.T).chunk(2, dim=-1)
    dense = (torch.nn.functional.silu(gate) * up) @ w2.T
    torch.testing.assert_close(only_0[picked], (dense * w)[picked], atol=1e-5, rtol=1e-5)


def test_missing_and_unexpected_weights_raise(tmp_path):
    make_checkpoint("llama_untied", tmp_path)
    from safetensors.torch import load_file

    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"missing weights.*qkv_proj.*unexpected weights.*extra"):
        load_model(str(tmp_path), torch.float32, "cpu")


def _tp_worker(rank, world_size, model_dir, init_file, out_path, expert_parallel=False):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = load_model(model_dir, torch.float32, "cpu", tp_group=dist.group.WORLD,
                           expert_parallel=expert_parallel)
        if expert_parallel:  # whole experts, half of them per rank
            experts = next(m for m in model.modules() if hasattr(m, "expected_shards"))  # the first MoE layer's
            assert experts.num_local_experts == experts.num_experts // world_size
            assert experts.w13_weight.shape[1] == 2 * experts.intermediate_size
        assert model.num_kv_heads == max(1, model.total_kv_heads // world_size)
        prompt = list(range(7, 20))
        seq = PagedSeq(seed=rank)  # each rank has its own cache; block ids need not agree
        cache = new_cache(model)
        logits = torch.cat([seq.step(model, cache, prompt), seq.step(model, cache, [3])])  # prefill, decode
        if rank == 0:
            torch.save(logits, out_path)
        dist.barrier()  # both ranks done before teardown: a rank leaving early makes gloo abort the other
    finally:
        dist.destroy_process_group()
    # Done and checked: leave without interpreter teardown, whose C++ static destruction can abort
    # the process (SIGABRT) while a gloo thread winds down, as pdserve's own ranks do (cli._exit_now).
    os._exit(0)


@pytest.mark.parametrize("name,expert_parallel", [("qwen2_untied", False), ("qwen3_tied", False), ("phi3", False),
                                                  ("qwen3_moe", False), ("mixtral", False), ("qwen3_moe", True),
                                                  ("mixtral", True), ("olmo2", False), ("olmo2_one_kv_head", False),
                                                  ("gemma3", False), ("deepseek_v3", False), ("deepseek_v3", True),
                                                  ("gpt_oss", False), ("gpt_oss", True)])
def test_tensor_parallel_2_matches_tp_1(name, expert_parallel, tmp_path):
    """Real sharding: two gloo ranks, each holding half the heads and MLP columns (Phi-3: each
    rank's rows of the checkpoint's fused q/k/v and gate/up tensors; MoE: half of every expert,
    or with expert parallelism half of the experts, whole; OLMo 2: q/k norms over heads on both
    ranks, its one KV head replicated; DeepSeek-V3: half the MLA heads, the latent replicated)."""
    import torch.multiprocessing as mp

    model_dir = tmp_path / "ckpt"
    make_checkpoint(name, model_dir)
    out_path = str(tmp_path / "logits.pt")
    mp.spawn(_tp_worker, args=(2, str(model_dir), str(tmp_path / "init"), out_path, expert_parallel), nprocs=2)
    tp2 = torch.load(out_path)
    model = load_model(str(model_dir), torch.float32, "cpu")
    seq, cache = PagedSeq(), new_cache(model)
    tp1 = torch.cat([seq.step(model, cache, list(range(7, 20))), seq.step(model, cache, [3])])
    torch.testing.assert_close(tp2, tp1, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_uses_index(tmp_path):
    """Weights split over several files with an index; a stray file outside the index is ignored."""
    hf = make_checkpoint("llama_tied_bias", tmp_path)
    os.remove(tmp_path / "model.safetensors")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    save_file({"output.weight": torch.zeros(2)}, str(tmp_path / "consolidated.safetensors"))
    model = load_model(str(tmp_path), torch.float32, "cpu")
    prompt = list(range(9, 21))
    logits = PagedSeq().step(model, new_cache(model), prompt)
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=1e-4)
