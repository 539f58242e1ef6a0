"""The shipped default model (pdserve/default_model/weights/stdlib-llama-v1) and the script that trains it."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import math
import pathlib
import shutil
import sysconfig
import textwrap

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.default_model.corpus import SPECIAL_TOKENS
from pdserve.default_model.train import (
    DEFAULT_MODEL_NAME, DEFAULT_TRAIN, chat_examples, encode_documents, evaluate_loss, read_texts,
    shipped_model_dir, stdlib_files, train,
)

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

PROMPTS = ["def ", "import os\n", "class ", "    def __init__(self"]
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir():
    return shipped_model_dir()


@pytest.fixture(scope="module")
def hf(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tok, model


def test_shipped_checkpoint_is_the_default(model_dir):
    assert model_dir.name == DEFAULT_MODEL_NAME
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    assert config["vocab_size"] == DEFAULT_TRAIN.vocab_size
    record = json.loads((model_dir / "training.json").read_text())
    assert record["config"] == dataclasses.asdict(DEFAULT_TRAIN)  # the shipped weights are the script's default
    assert (model_dir / "model.safetensors").stat().st_size < 10 * 2 ** 20


def test_default_model_command_prints_or_copies_the_checkpoint(model_dir, tmp_path, capsys):
    from pdserve.cli import main

    assert main(["default-model"]) == 0
    assert capsys.readouterr().out.strip() == str(model_dir)
    assert main(["default-model", str(tmp_path / "copy")]) == 0  # as the Dockerfile and ray up files run it
    assert capsys.readouterr().out.strip() == str(tmp_path / "copy")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "copy" / name).read_bytes() == (model_dir / name).read_bytes()


def test_tokenizer_keeps_pdserve_conventions(hf):
    tok, _ = hf
    assert tok.convert_ids_to_tokens(list(range(len(SPECIAL_TOKENS)))) == SPECIAL_TOKENS
    text = "def f(x):\n    return x  # ünïcode ✓\n"
    assert tok.decode(tok.encode(text)) == text and tok.encode(text)[0] >= len(SPECIAL_TOKENS)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_pdserve_greedy_equals_transformers(model_dir, hf):
    tok, model = hf
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS,
                                 do_sample=False, pad_token_id=2)
        expected.append(out[0, ids.shape[1]:].tolist())
    llm = LLM(dtype="float32", kv_cache_memory="4MiB", enforce_eager=True)  # no model: the shipped default
    assert llm.config.model == str(model_dir)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    for g, e in zip(got, expected):  # HF stops at EOS; pdserve too
        assert g == e
    assert any(len(g) == NUM_TOKENS for g in got)


def _heldout_stream(tok):
    _, heldout = stdlib_files()
    assert heldout, "no held-out standard-library files found"
    return encode_documents(tok._tokenizer, read_texts(heldout))


def test_heldout_perplexity_far_below_random(hf, model_dir):
    """On standard-library files the model never trained on, perplexity is a small fraction of the
    vocabulary (a random or untrained model sits near the vocabulary size or above)."""
    tok, model = hf
    stream = _heldout_stream(tok)[:40_000]
    loss = evaluate_loss(model, stream, seq_len=256, num_windows=16)
    assert math.exp(loss) < len(tok) / 32, f"held-out perplexity {math.exp(loss):.1f}"
    untrained = AutoModelForCausalLM.from_config(model.config).eval()
    assert evaluate_loss(untrained, stream, seq_len=256, num_windows=8) > math.log(len(tok) / 2)


def test_chat_examples_from_docstrings():
    src = 'def add(a, b):\n    """Add two numbers.\n\n    More text."""\n    return a + b\n\ndef bare(): pass\n'
    (chat,) = chat_examples([src, "def broken(:"])
    assert chat == ("<|im_start|>user\nAdd two numbers.<|im_end|>\n<|im_start|>assistant\n"
                    'def add(a, b):\n    """Add two numbers.\n\n    More text."""\n    return a + b<|im_end|>\n')
    # The fast line slicing gives exactly ast.get_source_segment's text (dedented), on real files.
    texts = read_texts([pathlib.Path(sysconfig.get_paths()["stdlib"]) / n for n in ("textwrap.py", "shlex.py")])
    chats = chat_examples(texts)
    segments = [textwrap.dedent(ast.get_source_segment(t, node, padded=True)) for t in texts
                for node in ast.walk(ast.parse(t)) if isinstance(node, ast.FunctionDef)
                and ast.get_docstring(node) and node.end_lineno - node.lineno < 40]
    assert len(chats) == len(segments) > 5
    assert all(c.endswith(f"assistant\n{seg}<|im_end|>\n") for c, seg in zip(chats, segments))


def test_split_is_disjoint_and_stable():
    train_files, heldout = stdlib_files()
    assert train_files and heldout and not set(train_files) & set(heldout)
    assert train_files == sorted(train_files) and all("test" not in p.parts for p in train_files)
    assert stdlib_files(max_files=5)[0] == train_files[:5]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# A small standard library for the training-script test: copy.py is held out (crc32 rule), the rest train.
SMALL_STDLIB = ["abc.py", "bisect.py", "colorsys.py", "copy.py", "fnmatch.py", "heapq.py", "keyword.py",
                "queue.py", "shlex.py", "string.py", "textwrap.py", "this.py"]


def test_training_is_deterministic(tmp_path):
    root = tmp_path / "stdlib"
    root.mkdir()
    for name in SMALL_STDLIB:
        shutil.copy(pathlib.Path(sysconfig.get_paths()["stdlib"]) / name, root / name)
    assert [p.name for p in stdlib_files(root)[1]] == ["copy.py"]
    tiny = dataclasses.replace(DEFAULT_TRAIN, vocab_size=400, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, seq_len=32,
                               max_position_embeddings=64, steps=3, batch_size=2, warmup_steps=1, eval_windows=2)
    runs = {}
    for name, cfg in [("a", tiny), ("b", tiny), ("c", dataclasses.replace(tiny, seed=1))]:
        runs[name] = train(tmp_path / name, cfg, stdlib_root=str(root), log=lambda _: None, progress=False)
    assert runs["a"] == runs["b"] and runs["a"]["num_train_files"] == len(SMALL_STDLIB) - 1
    for name in ("model.safetensors", "tokenizer.json", "config.json", "training.json"):
        assert _sha(tmp_path / "a" / name) == _sha(tmp_path / "b" / name), name
    assert _sha(tmp_path / "c" / "model.safetensors") != _sha(tmp_path / "a" / "model.safetensors")
    assert _sha(tmp_path / "c" / "tokenizer.json") == _sha(tmp_path / "a" / "tokenizer.json")
