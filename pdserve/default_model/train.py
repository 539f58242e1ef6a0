"""Train pdserve's default model: a small Llama on the Python standard library's own source.

No data can be downloaded, but every machine with Python has its standard library, so
the built-in default model learns from that: the ``.py`` files under
``sysconfig.get_paths()["stdlib"]`` (tests, ``site-packages`` and a few table-like or
generated packages left out, see :data:`EXCLUDED_DIRS`), in sorted order. About 1 in
20 files, picked by a CRC of the relative path, is held out for evaluation. Besides the
raw files the model sees chat examples built from the same training files: a function's
docstring summary as the user turn and the function's source as the assistant turn,
wrapped in the ChatML-like template of :mod:`pdserve.default_model.corpus`, so that
``/v1/chat/completions`` answers with code and stops at ``<|im_end|>``.

Pipeline (all deterministic): file list -> byte-level BPE (``tokenizers``, pdserve's
special tokens 0..4) -> one token stream (documents joined by ``</s>``) -> a
Hugging Face ``LlamaForCausalLM`` trained on seeded random windows with AdamW, fixed
thread count and ``torch.use_deterministic_algorithms`` -> a checkpoint directory that
plain ``transformers`` and pdserve load (:func:`pdserve.default_model.tiny_model.save_checkpoint`).

Determinism: the same Python standard library (it differs a little between Python
patch releases), the same torch / transformers / tokenizers versions and the same
thread count give the same weights. The shipped checkpoint records what it was
trained with in ``training.json``.

    python -m pdserve.default_model.train --out DIR             # the shipped default (minutes on 2 cores)
    python -m pdserve.default_model.train --out DIR --steps 50  # a quick look
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import pathlib
import platform
import sys
import sysconfig
import textwrap
import time
import zlib
from typing import TYPE_CHECKING, Callable

from pdserve.default_model.corpus import EOS_TOKEN, SPECIAL_TOKENS, train_bpe_on_texts
from pdserve.default_model.tiny_model import ModelPreset, save_checkpoint

if TYPE_CHECKING:
    import torch

__all__ = [
    "TrainConfig", "DEFAULT_TRAIN", "EXCLUDED_DIRS", "DEFAULT_MODEL_NAME", "shipped_model_dir",
    "stdlib_files", "read_texts", "chat_examples", "model_preset", "encode_documents",
    "evaluate_loss", "train",
]

DEFAULT_MODEL_NAME = "stdlib-llama-v1"  # the served model name is the directory's basename

# Directory names (anywhere in a file's relative path) whose files are not training text:
# tests, third-party packages, codec tables, generated topic dumps, demos, bundled wheels.
EXCLUDED_DIRS = frozenset({
    "test", "tests", "idle_test", "site-packages", "dist-packages", "encodings", "pydoc_data",
    "turtledemo", "ensurepip", "__pycache__", "lib2to3", "__phello__",
})
HELDOUT_EVERY = 20  # a file is held out when crc32(relative path) % HELDOUT_EVERY == 0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on (besides the standard library and library versions).

    Model shape: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``intermediate_size``, ``vocab_size`` (exact, incl. the 5
    special tokens), embeddings tied to the LM head. ``seq_len`` is the training context
    in tokens; ``max_position_embeddings`` (the served ``max_model_len``) may be longer,
    but text past ``seq_len`` tokens gets worse (RoPE positions the model never saw).
    Optimisation: ``steps`` of ``batch_size`` windows of ``seq_len + 1`` tokens, AdamW at
    peak ``lr`` with ``warmup_steps`` of linear warm-up then cosine decay to ``lr / 10``.
    ``max_files`` (None: all) keeps only the first files of the sorted list (for quick
    tests). ``num_threads`` is torch's intra-op thread count, fixed for reproducibility.
    """

    vocab_size: int = 4096
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    seq_len: int = 256
    max_position_embeddings: int = 1024
    steps: int = 1500
    batch_size: int = 8
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    chat_fraction_limit: float = 0.15  # chat examples at most this share of the stream's tokens
    max_files: int | None = None
    seed: int = 0
    num_threads: int = 2
    eval_windows: int = 32

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("hidden_size must divide by num_attention_heads, and that by num_key_value_heads")
        if min(self.steps, self.batch_size, self.seq_len, self.num_threads) < 1:
            raise ValueError("steps, batch_size, seq_len and num_threads must be >= 1")
        if self.max_position_embeddings < self.seq_len:
            raise ValueError("max_position_embeddings must be >= seq_len")


DEFAULT_TRAIN = TrainConfig()


def shipped_model_dir() -> pathlib.Path:
    """The trained default checkpoint inside the package (``pdserve/default_model/weights/stdlib-llama-v1``).

    Raises:
        FileNotFoundError: the package was installed without its data files.
    """
    path = pathlib.Path(__file__).resolve().parent / "weights" / DEFAULT_MODEL_NAME
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the default model is missing from {path}; reinstall pdserve or run "
                                f"`python -m pdserve.default_model.train --out {path}`")
    return path


def stdlib_files(root: str | os.PathLike | None = None,
                 max_files: int | None = None) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """The standard library's ``.py`` files as ``(train, heldout)`` lists, each sorted by relative path.

    ``root`` defaults to ``sysconfig.get_paths()["stdlib"]``. Files under :data:`EXCLUDED_DIRS`
    are skipped; a file is held out when ``crc32(relative posix path) % HELDOUT_EVERY == 0``
    (so the split of a file does not depend on which other files exist). ``max_files`` keeps
    the first ``max_files`` training files (and at most as many held-out ones).
    """
    base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    rel = sorted(p.relative_to(base).as_posix() for p in base.rglob("*.py")
                 if not set(p.relative_to(base).parts[:-1]) & EXCLUDED_DIRS)
    train_files = [base / r for r in rel if zlib.crc32(r.encode()) % HELDOUT_EVERY]
    heldout = [base / r for r in rel if not zlib.crc32(r.encode()) % HELDOUT_EVERY]
    if max_files is not None:
        train_files, heldout = train_files[:max_files], heldout[:max_files]
    return train_files, heldout


def read_texts(paths: list[pathlib.Path]) -> list[str]:
    """Each file's text (UTF-8, ``\\r\\n`` -> ``\\n``); files that are not valid UTF-8 are skipped."""
    texts = []
    for p in paths:
        try:
            texts.append(p.read_bytes().decode("utf-8").replace("\r\n", "\n"))
        except UnicodeDecodeError:
            continue
    return texts


def chat_examples(texts: list[str], max_lines: int = 40) -> list[str]:
    """ChatML conversations from functions with docstrings: user = the docstring's first
    paragraph, assistant = the function's source (dedented, at most ``max_lines`` lines).

    Each conversation is rendered with the layout of ``corpus.CHAT_TEMPLATE``
    (``<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n...<|im_end|>\\n``), in
    file order then source order. Files that do not parse are skipped.
    """
    out = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.split("\n")  # once per file: ast.get_source_segment re-splits the file per call
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc or node.end_lineno - node.lineno >= max_lines:
                continue
            summary = " ".join(doc.strip().split("\n\n")[0].split())
            body = lines[node.lineno - 1:node.end_lineno]
            body[-1] = body[-1].encode()[:node.end_col_offset].decode(errors="ignore")  # offsets are bytes
            code = textwrap.dedent("\n".join(body))
            if summary and code.strip():
                out.append(f"<|im_start|>user\n{summary}<|im_end|>\n<|im_start|>assistant\n{code}<|im_end|>\n")
    return out


def model_preset(cfg: TrainConfig) -> ModelPreset:
    """The checkpoint's shape as a :class:`ModelPreset` (for ``config.json``)."""
    return ModelPreset(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                       num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                       intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                       max_position_embeddings=cfg.max_position_embeddings, corpus_lines=0, lexicon_size=0,
                       tie_word_embeddings=True)


def encode_documents(tokenizer, docs: list[str]) -> torch.Tensor:
    """One ``[num_tokens] int64`` stream: each document's tokens followed by ``</s>``."""
    import torch

    eos = SPECIAL_TOKENS.index(EOS_TOKEN)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def _windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """``[len(starts), length]`` slices of ``stream``."""
    import torch

    return stream[starts[:, None] + torch.arange(length)[None, :]]


def _loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of ``batch: [B, T + 1]``."""
    import torch.nn.functional as F

    logits = model(input_ids=batch[:, :-1]).logits  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def evaluate_loss(model, stream: torch.Tensor, seq_len: int, num_windows: int, seed: int = 1234) -> float:
    """Mean next-token loss (nats) of ``model`` over ``num_windows`` seeded windows of ``stream``.

    ``stream: [num_tokens] int64``; windows are ``seq_len + 1`` tokens (fewer windows if the
    stream is short). Raises ValueError if the stream is shorter than one window.
    """
    import torch

    if len(stream) < seq_len + 1:
        raise ValueError(f"stream of {len(stream)} tokens is shorter than one window ({seq_len + 1})")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - seq_len, (num_windows,), generator=g)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        losses = [_loss(model, _windows(stream, starts[i:i + 8], seq_len + 1)).item()
                  for i in range(0, num_windows, 8)]
    model.train(was_training)
    return sum(losses) / len(losses)


def _lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(out_dir: str | os.PathLike, cfg: TrainConfig = DEFAULT_TRAIN, *, stdlib_root: str | None = None,
          log: Callable[[str], None] = print, progress: bool = True) -> dict:
    """Train the default model per ``cfg`` and write the checkpoint (and ``training.json``) to ``out_dir``.

    Returns the training record also written to ``training.json``: corpus and token counts,
    parameter count, final train / held-out loss (nats per token), and the Python, torch,
    transformers and tokenizers versions. Wall time is logged, not recorded, so the files
    stay byte-identical between identical runs. Changes torch's global thread count and
    deterministic-algorithms flag for the duration of the call.

    Raises:
        RuntimeError: the corpus is too small for ``cfg.vocab_size`` or ``cfg.seq_len``.
    """
    import tokenizers
    import torch
    import transformers
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    from pdserve.default_model.tiny_model import hf_config_dict, num_parameters

    t0 = time.perf_counter()
    train_files, heldout_files = stdlib_files(stdlib_root, cfg.max_files)
    code, heldout_code = read_texts(train_files), read_texts(heldout_files)
    tokenizer = train_bpe_on_texts(code, cfg.vocab_size)
    code_ids = encode_documents(tokenizer, code)
    chats = chat_examples(code)
    chat_ids = encode_documents(tokenizer, chats)[: int(cfg.chat_fraction_limit * len(code_ids))]
    stream = torch.cat([code_ids, chat_ids])
    heldout = encode_documents(tokenizer, heldout_code)
    if len(stream) < 2 * (cfg.seq_len + 1) or len(heldout) < cfg.seq_len + 1:
        raise RuntimeError(f"corpus too small: {len(stream)} train / {len(heldout)} held-out tokens "
                           f"for windows of {cfg.seq_len + 1}")
    log(f"corpus: {len(code)} train files ({len(code_ids):,} tokens) + {len(chats)} chat examples "
        f"({len(chat_ids):,} tokens), {len(heldout_code)} held-out files ({len(heldout):,} tokens); "
        f"tokenizer and encoding took {time.perf_counter() - t0:.1f}s")

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(cfg.num_threads)
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(cfg.seed)
        preset = model_preset(cfg)
        hf_cfg = {k: v for k, v in hf_config_dict(preset).items() if k not in ("architectures", "torch_dtype")}
        model = LlamaForCausalLM(LlamaConfig(**hf_cfg, attn_implementation="sdpa")).float()
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
        g = torch.Generator().manual_seed(cfg.seed)
        model.train()
        t1 = time.perf_counter()
        bar = tqdm(range(cfg.steps), desc="training", unit="step", disable=not progress, mininterval=1.0)
        for step in bar:
            for group in opt.param_groups:
                group["lr"] = _lr_at(cfg, step)
            starts = torch.randint(0, len(stream) - cfg.seq_len, (cfg.batch_size,), generator=g)
            loss = _loss(model, _windows(stream, starts, cfg.seq_len + 1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        train_s = time.perf_counter() - t1
        train_loss = evaluate_loss(model, stream, cfg.seq_len, cfg.eval_windows)
        heldout_loss = evaluate_loss(model, heldout, cfg.seq_len, cfg.eval_windows)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)

    weights = {k: v.detach() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    out = save_checkpoint(out_dir, preset, tokenizer, weights)
    record = {
        "config": dataclasses.asdict(cfg),
        "num_parameters": num_parameters(preset),
        "num_train_files": len(code), "num_heldout_files": len(heldout_code), "num_chat_examples": len(chats),
        "num_train_tokens": len(stream), "num_heldout_tokens": len(heldout),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "train_loss": round(train_loss, 4), "heldout_loss": round(heldout_loss, 4),
        "heldout_perplexity": round(math.exp(heldout_loss), 2),
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    log(f"trained {record['num_parameters']:,} parameters for {cfg.steps} steps in {train_s:.0f}s "
        f"({record['tokens_seen'] / train_s:,.0f} tokens/s); loss train {train_loss:.3f}, "
        f"held-out {heldout_loss:.3f} (perplexity {record['heldout_perplexity']}); wrote {out}")
    return record


def _main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Train pdserve's default model on the Python standard library.")
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--steps", type=int, default=DEFAULT_TRAIN.steps)
    ap.add_argument("--num-threads", type=int, default=DEFAULT_TRAIN.num_threads)
    ap.add_argument("--seed", type=int, default=DEFAULT_TRAIN.seed)
    args = ap.parse_args(argv)
    cfg = dataclasses.replace(DEFAULT_TRAIN, steps=args.steps, num_threads=args.num_threads, seed=args.seed)
    t0 = time.perf_counter()
    train(args.out, cfg)
    print(f"total {time.perf_counter() - t0:.0f}s (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    _main()
