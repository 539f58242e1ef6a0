"""Random-weight checkpoints that transformers itself writes, for the tests that compare pdserve with it."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_checkpoint(config, path: Path, tokenizer_dir: str, perturb_biases: bool = True) -> str:
    """Save ``AutoModelForCausalLM.from_config(config)`` (float32, seed 0) at ``path`` with the tokenizer files of
    ``tokenizer_dir``. Norm weights (and biases, with ``perturb_biases``) get seeded noise of 0.1 so that a
    model which skipped them would not pass for one that applies them. Returns ``str(path)``."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or (perturb_biases and name.endswith("bias")):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(path)
    for f in TOKENIZER_FILES:
        shutil.copy(f"{tokenizer_dir}/{f}", Path(path) / f)
    return str(path)


def greedy_reference(hf, prompt_ids: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """transformers' own greedy ``generate`` on a loaded model, one prompt at a time: (tokens, each chosen
    token's logprob) per prompt."""
    out = []
    for ids in prompt_ids:
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
        tokens = gen.sequences[0, len(ids):].tolist()
        out.append((tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(gen.logits, tokens)]))
    return out
