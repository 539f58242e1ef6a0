"""Draft-model proposals: a small model of the target's vocabulary guesses ``k`` tokens.

The draft model runs in the decode worker's process with its own paged KV cache,
as many blocks as the target's and indexed by the same block tables: position
``p`` of a request has its draft K/V in the same slot as its target K/V. Each
request tracks ``num_draft_computed_tokens``; a proposal first catches the draft
up on the tokens it has not seen (a whole prompt the first time, since prompts
are prefilled by the target or by a prefill worker), then runs ``k - 1`` more
single-token steps. The scheduler reserved the target slots for ``[last token,
d_1 .. d_k]``, and the draft writes only the first ``k`` of them. After
verification ``num_draft_computed_tokens`` is cut back to the tokens that were
accepted (the draft's K/V of accepted drafts is valid: same token, same position).

Greedy requests get the draft's argmax (a point mass); sampled ones draw from
the draft's temperature-scaled distribution ``q``, which travels to the
rejection sampler (``Request.spec_draft_probs``).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from transformers import AutoConfig

from pdserve.engine.execution.kv_cache import copy_blocks, kv_cache_block_bytes
from pdserve.engine.execution.model_runner import ModelRunner
from pdserve.engine.scheduling.step_inputs import flatten_step
from pdserve.engine.scheduling.request import Request
from pdserve.engine.execution.sampler import is_greedy

logger = logging.getLogger(__name__)


class DraftModelProposer:
    """Loads the draft model beside the target and proposes drafts into reserved slots.

    Args:
        model: the draft checkpoint directory.
        num_speculative_tokens: k, drafts per request and step.
        target_runner: the target's ``ModelRunner`` (its block layout, dtype, device and
            vocabulary are the draft's too).

    Raises:
        ValueError: the draft's vocabulary differs from the target's.
    """

    drafts_at_execute = True  # the scheduler reserves slots; ``propose`` fills them in at execute

    def __init__(self, model: str, num_speculative_tokens: int, target_runner):
        self.num_speculative_tokens = num_speculative_tokens
        target = target_runner
        hf = AutoConfig.from_pretrained(model)
        if int(hf.vocab_size) != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({hf.vocab_size}) differs from the target's "
                             f"({target.vocab_size}); drafts must be the target's tokens")
        if getattr(hf, "kv_lora_rank", None):  # MLA: one latent row (plus the rope key) per token, one slot
            num_kv_heads, head_dim, kv_slots = 1, int(hf.kv_lora_rank) + int(hf.qk_rope_head_dim), 1
        else:
            num_kv_heads = int(getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)
            head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
            kv_slots = 2
        kv_name = target.kv_cache_format.name  # the draft's cache is the target's format (quantized or not)
        block_bytes = kv_cache_block_bytes(int(hf.num_hidden_layers), target.block_size, num_kv_heads, head_dim,
                                           kv_name, kv_slots)
        dtype = str(target.dtype).removeprefix("torch.")
        config = dataclasses.replace(
            target.config, model=model, dtype=dtype, kv_cache_dtype=kv_name,
            kv_cache_memory=target.num_blocks * block_bytes, max_model_len=target.max_model_len, enforce_eager=True,
            tensor_parallel_size=1, pipeline_parallel_size=1, rank=0, speculative_config=None,
            enable_lora=False,  # the draft model proposes without adapters; the target verifies with them
            disable_hybrid_kv_cache_manager=True,  # its layers read the target's one table per request
            quantization=None)  # the draft's own checkpoint says whether it is quantized (compressed-tensors)
        self.runner = ModelRunner(config)
        assert self.runner.num_blocks == target.num_blocks, (self.runner.num_blocks, target.num_blocks)
        logger.info("draft model %s: %d layers, KV cache %.1f MiB", model, self.runner.num_layers,
                    self.runner.kv_cache_bytes / 2**20)

    def num_lookahead(self, request: Request, max_k: int) -> int:
        """The scheduler's hook: reserve k slots; the drafts are made at execute (``propose``)."""
        return min(self.num_speculative_tokens, max_k)

    @torch.inference_mode()
    def propose(self, scheduled: list[tuple[Request, int]], block_copies: list[tuple[int, int]]) -> None:
        """Fill ``spec_token_ids`` (and ``spec_draft_probs``) of every request scheduled with drafts.

        Args:
            scheduled: the step's (request, num_new_tokens); a request with drafts has
                ``num_new_tokens = 1 + k`` and its last token not yet computed.
            block_copies: the step's copy-on-write copies, applied to the draft cache first.
        """
        if block_copies:
            copy_blocks(self.runner.kv_cache, block_copies)
        todo = [(r, n - 1) for r, n in scheduled if n > 1 and r.num_computed_tokens == r.num_tokens - 1]
        if not todo:
            return
        for r, _ in todo:
            r.spec_token_ids = []
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in todo}
        # Step 1 catches the draft up to the last token; steps 2..k feed the previous draft.
        for j in range(max(k for _, k in todo)):
            active = [(r, k) for r, k in todo if k > j]
            logits = self._forward(active, first=(j == 0))
            self._pick(active, logits, probs)
        for r, k in todo:
            r.num_draft_computed_tokens = r.num_tokens + k - 1
            r.spec_draft_probs = None if is_greedy(r.sampling_params) else torch.stack(probs[r.request_id])

    def _forward(self, active: list[tuple[Request, int]], first: bool) -> torch.Tensor:
        """One draft forward; [len(active), vocab_size] logits at each request's newest position."""
        spans = []
        for r, _ in active:
            end = r.num_tokens + len(r.spec_token_ids)  # through the newest draft (first: the last sampled token)
            spans.append((r, r.num_draft_computed_tokens if first else end - 1, end))
        step = flatten_step(spans, self.runner.block_size, self.runner.rope_needs_lengths)
        step.sample_indices = [last_row - 1 for last_row in step.query_start_loc[1:]]
        hidden = self.runner.run_step(step)
        return self.runner.model.compute_logits(hidden)

    def _pick(self, active: list[tuple[Request, int]], logits: torch.Tensor,
              probs: dict[str, list[torch.Tensor]]) -> None:
        """Append one draft per active request: the argmax, or a draw from softmax(logits / T)."""
        argmax = logits.argmax(dim=-1).tolist()
        for i, (r, _) in enumerate(active):
            params = r.sampling_params
            if is_greedy(params):
                r.spec_token_ids.append(argmax[i])
                continue
            q = (logits[i] / params.temperature).softmax(dim=-1)
            gen = None
            if params.seed is not None:
                gen = torch.Generator().manual_seed((params.seed * 7919 + r.num_tokens + len(r.spec_token_ids))
                                                    % 2**63)
            r.spec_token_ids.append(int(torch.multinomial(q, 1, generator=gen)))
            probs[r.request_id].append(q)
