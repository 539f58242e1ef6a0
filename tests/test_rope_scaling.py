"""Length-dependent RoPE scaling (``longrope``, ``dynamic``) against transformers.

Two tiny random checkpoints written by transformers itself: a Phi-3 with LongRoPE (original length
32, max_position_embeddings 128, partial rotary, distinct short and long factors) and a Llama with
dynamic NTK scaling (max_position_embeddings 32, factor 4). Three prompts per model: one whose
generation stays within the original length, one longer than it from the start, and one whose
generation crosses it (transformers then uses the scaled frequencies for the new tokens while the
cached keys keep the unscaled ones; Phi-3's ``generate`` instead recomputes the whole sequence at
that step). pdserve must give each transformers' single-sequence ``generate`` tokens, alone and
batched with the others (the length is per request), with the decode step compiled.
"""

from __future__ import annotations


import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config

from pdserve import LLM, SamplingParams
from pdserve.engine.layers.attention import AttentionMetadata
from pdserve.kernels import load_paged_attention
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.decoder import rope_settings, rotary_dim as rotary_dim_of
from tests.checkpoints import write_checkpoint

ORIGINAL = 32  # the pretraining length of both checkpoints (longrope's original, dynamic's max_position_embeddings)
COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
              num_hidden_layers=2, vocab_size=2048, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False)
CONFIGS = {
    # head_dim 32, half of it rotating: 8 factors per list
    "phi3_longrope": lambda: Phi3Config(
        **COMMON, max_position_embeddings=4 * ORIGINAL, original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=0.5,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5],
                         "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 20.0, 32.0, 48.0]}),
    "llama_dynamic": lambda: LlamaConfig(
        **COMMON, max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}),
}
# (prompt length, new tokens): below the original length throughout; longer from the start; crossing it
CASES = {"below": (10, 16), "above": (44, 10), "crossing": (24, 20)}


def _prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, COMMON["vocab_size"], (length,), generator=g).tolist()


PROMPTS = {name: _prompt(n, seed) for seed, (name, (n, _)) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def rope_dirs(model_dir, tmp_path_factory) -> dict[str, str]:
    return {name: write_checkpoint(make_config(), tmp_path_factory.mktemp(name), model_dir, perturb_biases=False)
            for name, make_config in CONFIGS.items()}


def _hf_generate(path: str, ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs for one prompt alone, from a freshly loaded model
    (its dynamic RoPE keeps a cached length from one call to the next)."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    tokens = gen.sequences[0, len(ids):].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(gen.logits, tokens)]


def _hf_incremental(path: str, ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy decoding through transformers' model forward with its KV cache, one token per step:
    what ``generate`` does minus Phi-3's ``prepare_inputs_for_generation``, which drops the cache and
    recomputes the whole sequence on the step that first exceeds ``original_max_position_embeddings``."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, logprobs = [], []
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids]), use_cache=True)
        for i in range(max_tokens):
            logp = torch.log_softmax(out.logits[0, -1].float(), -1)
            tokens.append(int(logp.argmax()))
            logprobs.append(logp[tokens[-1]].item())
            if i + 1 < max_tokens:
                out = hf(input_ids=torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[len(ids) + i]]),
                         cache=out.past_key_values, use_cache=True)
    return tokens, logprobs


def _reference(name: str, path: str, case: str) -> tuple[list[int], list[float]]:
    """transformers' ``generate`` tokens and logprobs for one case."""
    ids, n = PROMPTS[case], CASES[case][1]
    return _hf_generate(path, ids, n)


def _assert_matches(out, want: tuple[list[int], list[float]], what: str) -> None:
    got = out.outputs[0]
    assert got.token_ids == want[0], what
    assert max(abs(g.logprob - w) for g, w in zip(got.logprobs, want[1])) < 1e-4, what


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_rotary_matches_transformers_per_request(kind, rope_dirs):
    """The layer alone: two requests in one flat batch (one below, one above the original length, a
    prefill and a decode-shaped step) rotate as transformers' rotary embedding does for each alone."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    name = "phi3_longrope" if kind == "longrope" else "llama_dynamic"
    hf = AutoModelForCausalLM.from_pretrained(rope_dirs[name], dtype=torch.float32).eval()
    config = hf.config
    head_dim = config.hidden_size // config.num_attention_heads
    theta, scaling = rope_settings(config)
    rotary_dim = rotary_dim_of(config, head_dim)
    rope = RotaryEmbedding(head_dim, theta, scaling, rotary_dim=rotary_dim,
                           max_position_embeddings=config.max_position_embeddings)
    assert rope.length_scaling == kind
    torch.manual_seed(1)
    for lens in ([20, 50], [1, 1]):  # prefill of two prompts; then decode at positions 20 and 50
        new = lens if lens[0] > 1 else [1, 1]
        ends = [20, 50] if lens[0] > 1 else [21, 51]
        positions = torch.cat([torch.arange(e - n, e) for e, n in zip(ends, new)])
        md = AttentionMetadata.build([[0] * 4, [0] * 4], [e - n for e, n in zip(ends, new)], new, block_size=16)
        q = torch.randn(len(positions), 2, head_dim)
        k = torch.randn(len(positions), 1, head_dim)
        got_q, got_k = rope(positions, q, k, md)
        start = 0
        for e, n in zip(ends, new):
            rows = slice(start, start + n)
            start += n
            hf_rope = type(hf.model.rotary_emb)(config)  # fresh: no cached length from another sequence
            pos = positions[rows][None]
            cos, sin = hf_rope(q, pos)
            # transformers' layout [batch, heads, seq, dim]; its rotary part is the first rotary_dim features
            q_hf, k_hf = q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None]
            rq, rk = apply_rotary_pos_emb(q_hf[..., :rotary_dim], k_hf[..., :rotary_dim], cos, sin)
            torch.testing.assert_close(got_q[rows][..., :rotary_dim], rq[0].transpose(0, 1), rtol=0, atol=1e-5)
            torch.testing.assert_close(got_k[rows][..., :rotary_dim], rk[0].transpose(0, 1), rtol=0, atol=1e-5)
            torch.testing.assert_close(got_q[rows][..., rotary_dim:], q[rows][..., rotary_dim:])


@pytest.mark.skipif(load_paged_attention() is None, reason="no C++ compiler: the decode step is not compiled")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_llm_matches_transformers_alone_and_batched(name, rope_dirs):
    """Each case alone, then all three in one batch (their prefills share a step, then their decodes):
    transformers' tokens and logprobs every time, with the decode step compiled."""
    import torch._dynamo.utils

    path = rope_dirs[name]
    want = {case: _reference(name, path, case) for case in CASES}
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    params = {case: SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, ignore_eos=True)
              for case, (_, n) in CASES.items()}
    with LLM(path, max_model_len=4 * ORIGINAL, kv_cache_memory="2MiB", enforce_eager=False) as llm:
        assert llm.core.runner._compiled_decode is not None
        for case in CASES:
            [out] = llm.generate([PROMPTS[case]], params[case], use_tqdm=False)
            _assert_matches(out, want[case], f"{name} {case} alone")
        outs = llm.generate([PROMPTS[c] for c in CASES], [params[c] for c in CASES], use_tqdm=False)
        for case, out in zip(CASES, outs):
            _assert_matches(out, want[case], f"{name} {case} batched")
    # one graph: the per-request length is tensor arithmetic, no data-dependent branch
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks, \
        dict(torch._dynamo.utils.counters["graph_break"])


def test_phi3_recomputes_its_sequence_at_the_crossing_as_generate_does(rope_dirs):
    """transformers' Phi-3 ``generate`` drops its cache on the step that first exceeds the original length
    and recomputes every key with the long factor; its tokens then differ from keeping the short-factor
    keys (the step-by-step forward), so the crossing case above checks pdserve's recompute. Here: that
    difference is real, and pdserve's request recomputed exactly once (also under 8-token chunks)."""
    path, ids, n = rope_dirs["phi3_longrope"], PROMPTS["crossing"], CASES["crossing"][1]
    generated, incremental = _hf_generate(path, ids, n), _hf_incremental(path, ids, n)
    crossing = ORIGINAL + 1 - len(ids)  # the first token sampled from a forward longer than the original
    assert generated[0][:crossing] == incremental[0][:crossing]
    assert generated[0] != incremental[0]
    params = SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, ignore_eos=True)
    with LLM(path, max_model_len=4 * ORIGINAL, kv_cache_memory="2MiB", max_num_batched_tokens=8) as llm:
        assert llm.core.scheduler.config.recompute_past_len == ORIGINAL
        llm.core.add_request("r", ids, params)
        request = llm.core.scheduler.requests["r"]
        computed = []
        while llm.core.has_unfinished():
            llm.core.step()
            computed.append(request.num_computed_tokens)
        assert request.rope_recomputed
    drops = [i for i in range(1, len(computed)) if computed[i] < computed[i - 1]]
    assert len(drops) == 1 and computed[drops[0] - 1] == ORIGINAL  # dropped once, from 32 cached tokens


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_prefill_takes_the_whole_prompts_length_and_prefix_caching_is_off(name, rope_dirs):
    """A 44-token prompt prefilled in 8-token chunks: its first chunks lie below the original length, yet
    they take the whole prompt's frequencies, as transformers' one-shot prefill does (each chunk's own end
    would give the unscaled ones). A repeated prompt is never a prefix hit: a block's K depends on the
    length of the request that computed it."""
    path = rope_dirs[name]
    want = _reference(name, path, "above")
    params = SamplingParams(max_tokens=CASES["above"][1], temperature=0.0, logprobs=0, ignore_eos=True)
    with LLM(path, max_model_len=4 * ORIGINAL, kv_cache_memory="2MiB", max_num_batched_tokens=8,
             enable_prefix_caching=True) as llm:
        assert not llm.core.block_manager.enable_prefix_caching
        for _ in range(2):
            [out] = llm.generate([PROMPTS["above"]], params, use_tqdm=False)
            _assert_matches(out, want, f"{name} chunked")
            assert out.num_cached_tokens == 0
