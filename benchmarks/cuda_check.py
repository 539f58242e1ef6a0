"""The engine on a CUDA GPU against transformers on the same GPU: every family, eager and compiled.

    python benchmarks/cuda_check.py                 # every family in tests/checkpoints.py, plus Llama
    python benchmarks/cuda_check.py --families llama gemma3 --dtypes float32

CI has no GPU, so the CUDA paths (the attention backend in plain torch, the compiled decode step
under Inductor/Triton, the KV checksum, the tables on the device) run only where this script is
run by hand. For each family it writes the small random-weight checkpoint the tests use
(``tests/checkpoints.py``), runs transformers' greedy ``generate`` on the GPU as the reference, and
``LLM(device="cuda")`` with chunked prefill (16-token steps), prefix caching and a KV budget that
forces preemption, once eager and once asking for the compiled decode step (the engine compiles
it only for the CPU paged backend; elsewhere it says so and runs eagerly, and the line says which
ran). It prints one line per run: where the greedy tokens first differ, if anywhere, and the
largest logprob difference before that point. Exit status 1 if a float32 run's tokens differ or
its logprobs are off by more than 1e-3. bfloat16 runs are reported, never failed: the two sides
round at different points (pdserve's norms and softmax in float32), so near-ties flip.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.checkpoints: the tests' own checkpoints

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.default_model.tiny_model import write_tiny_model  # noqa: E402
from tests.checkpoints import FAMILIES, PROMPTS, greedy_reference, write_checkpoint  # noqa: E402

FLOAT32_LOGPROB_TOLERANCE = 1e-3


def run_family(path: str, dtype: str, eager: bool, max_tokens: int,
               device: str = "cuda") -> tuple[int | None, float, float, bool]:
    """``LLM`` on ``device`` against transformers there: (the first position where a prompt's greedy tokens
    differ, None if none; the largest logprob difference over the positions before it; seconds; whether
    the decode step ran compiled)."""
    tok = AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    torch_dtype = getattr(torch, dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device).eval()
    ref = greedy_reference(hf, prompt_ids, max_tokens)
    del hf
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    started = time.perf_counter()
    llm = LLM(path, device=device, dtype=dtype, enforce_eager=eager, max_num_batched_tokens=16,
              enable_prefix_caching=True, kv_cache_memory="64MiB")
    try:
        compiled = llm.core.runner._compiled_decode is not None
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    finally:
        llm.close()
    seconds = time.perf_counter() - started
    first_diff, worst = None, 0.0
    for (want, want_lp), out in zip(ref, outputs):
        got = out.outputs[0]
        same = next((i for i, (a, b) in enumerate(zip(got.token_ids, want)) if a != b), len(want))
        if same < len(want):
            first_diff = same if first_diff is None else min(first_diff, same)
        # past a differing token the two continue from different contexts: their logprobs no longer compare
        worst = max([worst, *(abs(g.logprob - w) for g, w in zip(got.logprobs[:same + 1], want_lp[:same + 1]))])
    return first_diff, worst, seconds, compiled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["llama", *FAMILIES])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu runs the same check here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cuda_check: no CUDA device here; nothing to check")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on both sides
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"cuda_check: {name}, torch {torch.__version__}")
    failed = False
    with tempfile.TemporaryDirectory() as root:
        tiny = str(write_tiny_model(Path(root) / "llama", preset="tiny"))
        for family in args.families:
            path = tiny if family == "llama" else write_checkpoint(FAMILIES[family](), Path(root) / family, tiny)
            for dtype in args.dtypes:
                for mode in args.modes:
                    eager = mode == "eager"
                    try:
                        first_diff, worst, seconds, compiled = run_family(path, dtype, eager, args.max_tokens,
                                                                          args.device)
                    except Exception as e:  # noqa: BLE001  one family's failure is its line; the rest still run
                        print(f"{family:12s} {dtype:9s} {mode:8s} ERROR {type(e).__name__}: {e}")
                        failed = True
                        continue
                    bad = dtype == "float32" and (first_diff is not None or worst > FLOAT32_LOGPROB_TOLERANCE)
                    failed |= bad
                    ran = "compiled" if compiled else "eager" + (" (the engine did not compile: see its log)"
                                                                  if not eager else "")
                    tokens = "equal" if first_diff is None else f"first differ at token {first_diff}"
                    print(f"{family:12s} {dtype:9s} asked {mode:8s} ran {ran}: {args.max_tokens} tokens x "
                          f"{len(PROMPTS)} prompts {tokens}, max |logprob diff| before it {worst:.2e}, "
                          f"{seconds:.1f} s{'  FAIL' if bad else ''}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
