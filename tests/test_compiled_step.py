"""The compiled decode step (torch.compile over the paged kernel) against eager and Hugging Face."""

from __future__ import annotations

import shutil

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.layers import panel_linear
from pdserve.kernels import load_paged_attention
from tests.helpers.reference import GREEDY, hf_greedy, prompts, token_ids  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(load_paged_attention() is None, reason="no C++ compiler: nothing is compiled")


@pytest.fixture(scope="module")
def compiled(model_dir):
    llm = LLM(model_dir, max_num_batched_tokens=32, kv_cache_memory="1MiB", enforce_eager=False,
              decode_step_compile="background")
    yield llm
    llm.close()


def test_compiled_decode_is_token_exact_with_hf(compiled, prompts, hf_greedy):  # noqa: F811
    """Built in the background: steps run eagerly while it compiles, then compiled; both token-exact."""
    runner = compiled.core.runner
    assert runner._compile_thread is not None and runner.plan["decode_step"] == "compiled"
    assert runner.decode_step_state in ("compiling", "compiled")
    early = compiled.generate(prompts, GREEDY, use_tqdm=False)  # eager steps, or compiled ones if it was quick
    assert token_ids(early) == hf_greedy
    assert runner.wait_for_compiled_step(timeout_s=600)
    assert runner._compiled_decode is not None and runner.decode_step_state == "compiled"
    outputs = compiled.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == hf_greedy
    assert compiled.block_manager.num_free_blocks == compiled.block_manager.num_blocks


def test_compiling_never_writes_the_kv_cache_requests_hold(model_dir):
    """The warm-up runs on a scratch cache: a background compile must not touch blocks in use."""
    from pdserve.engine.execution.compiled_step import CompiledDecodeStep

    llm = LLM(model_dir, kv_cache_memory="1MiB", enforce_eager=True)
    try:
        runner = llm.core.runner
        runner.kv_cache.fill_(0.25)  # every slot "held" by some request
        before = runner.kv_cache.clone()
        step = CompiledDecodeStep.build(runner)
        assert step is not None
        assert torch.equal(runner.kv_cache, before)
        # and the graphs compiled on the scratch cache serve the real one, with no new graph (a recompile)
        runner._compiled_decode = step
        graphs = dict(torch._dynamo.utils.counters["stats"])
        assert graphs.get("unique_graphs")  # dynamo counts the graphs it made
        batch = [[5, 17, 300, 41, 9, 77], [7, 8, 9]]  # batch 2, then batch 1
        got = llm.generate(batch, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        assert dict(torch._dynamo.utils.counters["stats"]).get("unique_graphs") == graphs.get("unique_graphs")
        want = LLM(model_dir, kv_cache_memory="1MiB", enforce_eager=True)
        try:
            assert token_ids(got) == token_ids(want.generate(batch, SamplingParams(max_tokens=8, temperature=0.0),
                                                             use_tqdm=False))
        finally:
            want.close()
    finally:
        llm.close()


def test_compiled_logprobs_match_eager(model_dir, compiled, prompts):  # noqa: F811
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)
    eager = LLM(model_dir, max_num_batched_tokens=32, kv_cache_memory="1MiB", enforce_eager=True)
    assert eager.core.runner._compiled_decode is None
    want = eager.generate(prompts, params, use_tqdm=False)
    got = compiled.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lg.top_token_ids == lw.top_token_ids
            assert abs(lg.logprob - lw.logprob) < 1e-4
            assert all(abs(a - b) < 1e-4 for a, b in zip(lg.top_logprobs, lw.top_logprobs))


def test_compiled_decode_step_over_an_int8_cache_matches_eager(model_dir):
    """torch.compile'd decode step: the opaque decode op takes the uint8 cache and the KV dtype name."""
    prompts = [[5, 17, 300, 41, 9, 77], list(range(100, 137))]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    outputs = {}
    for eager in (True, False):
        llm = LLM(model_dir, kv_cache_dtype="int8", kv_cache_memory="1MiB", enforce_eager=eager)
        try:
            assert (llm.core.runner._compiled_decode is None) == eager
            outputs[eager] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.close()
    for want, got in zip(outputs[True], outputs[False]):
        assert got.token_ids == want.token_ids
        for lw, lg in zip(want.logprobs, got.logprobs):
            assert abs(lg.logprob - lw.logprob) < 1e-4


def test_no_request_pays_a_recompilation(model_dir):
    """Start-up compiles every graph a decode step can need: batches of 1, of the decode linear
    kernel's 2 to KERNEL_MAX_ROWS rows and of more, over contexts of any block count, run on them without a new
    graph (a recompilation costs a request about a second)."""
    import torch._dynamo.utils

    from pdserve.engine.layers.decode_linear import KERNEL_MAX_ROWS

    with LLM(model_dir, kv_cache_memory="4MiB", enforce_eager=False, max_num_seqs=2 * KERNEL_MAX_ROWS) as llm:
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)  # contexts past 3 blocks of 16
        for batch in (1, 3, KERNEL_MAX_ROWS + 4):
            llm.generate([[5 + i, 17, 300, 41 + i] for i in range(batch)], params, use_tqdm=False)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_two_compiled_models_in_one_process_keep_their_own_graphs(model_dir, compiled, prompts, hf_greedy,  # noqa: F811
                                                                   tmp_path):
    """With dynamo's guards on the model's modules dropped, one model's graphs still never serve another's step
    (here: a qwen3 of another width and depth, compiled after the tiny model, then the tiny model again): each
    gives transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.checkpoints import FAMILIES, greedy_reference, write_checkpoint

    other_dir = write_checkpoint(FAMILIES["qwen3"](), tmp_path / "qwen3", model_dir)
    other = LLM(other_dir, max_num_batched_tokens=32, kv_cache_memory="1MiB", enforce_eager=False)
    try:
        assert other.core.runner._compiled_decode is not None
        tokenizer = AutoTokenizer.from_pretrained(other_dir)
        hf = AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32).eval()
        ids = [tokenizer.encode(p) for p in prompts[2:5]]
        want = [tokens for tokens, _ in greedy_reference(hf, ids, 12)]
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        got = other.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
        assert token_ids(got) == want
        assert token_ids(compiled.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy
    finally:
        other.close()


@pytest.mark.skipif(not panel_linear.build_kernel(), reason="no C++ compiler to build the panel kernel")
def test_two_models_of_one_shape_each_run_their_own_graphs(model_dir, prompts, tmp_path):  # noqa: F811
    """A packed linear's handle is a constant of the compiled graph, unguarded: two models of one shape
    (the tiny model, and a twin with other weights) each compile their own graphs and each give their own
    transformers greedy tokens, the second one compiled while the first still lives."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.checkpoints import greedy_reference

    twin_dir = tmp_path / "twin"
    shutil.copytree(model_dir, twin_dir)
    weights = load_file(twin_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(7)
    for name, w in weights.items():
        if name.endswith("proj.weight"):
            weights[name] = w + 0.5 * w.std() * torch.randn(w.shape, generator=generator)
    save_file(weights, twin_dir / "model.safetensors", metadata={"format": "pt"})
    ids = [AutoTokenizer.from_pretrained(model_dir).encode(p) for p in prompts[2:5]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llms = []
    try:
        for directory in (model_dir, twin_dir):
            hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
            want = [tokens for tokens, _ in greedy_reference(hf, ids, 12)]
            llms.append(LLM(str(directory), linear_weight_format="panel", kv_cache_memory="1MiB", enforce_eager=False))
            assert llms[-1].core.runner._compiled_decode is not None
            got = llms[-1].generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
            assert token_ids(got) == want
        assert token_ids(llms[0].generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)) != want
    finally:
        for llm in llms:
            llm.close()


def test_the_compile_cache_outlives_tmp_unless_the_user_names_one(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from pdserve.engine.execution.compiled_step import use_persistent_compile_cache

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert use_persistent_compile_cache() == str(tmp_path / ".cache" / "pdserve" / "inductor") == cache_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_persistent_compile_cache() == str(tmp_path / "mine") == cache_dir()
