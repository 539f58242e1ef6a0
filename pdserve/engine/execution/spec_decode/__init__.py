"""Speculative decoding on the decode side: propose, verify in one forward, keep what the target accepts.

A cheap proposer guesses the next ``k`` tokens of a decoding request; the
target model scores the last sampled token and the ``k`` drafts in one forward
(``k + 1`` query rows over the paged KV); rejection sampling keeps a prefix of
the drafts and adds one token of its own, so every step emits between 1 and
``k + 1`` tokens and the output follows the target's distribution exactly
(Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative
Decoding", ICML 2023; Chen et al., "Accelerating Large Language Model Decoding
with Speculative Sampling", 2023). Proposers, as vLLM names them:

* ``ngram`` (prompt lookup decoding, Saxena 2023): the longest suffix n-gram of
  the sequence found earlier in it; the tokens that followed are the drafts.
  No model, no KV; strong when the output copies its context (code editing).
* ``draft_model``: a small model of the same vocabulary, with its own paged KV
  cache indexed by the target's block tables, runs ``k`` greedy/sampled steps.

Life of a step with speculation (``EngineCore``)::

    schedule: a decode request gets 1 + k tokens of the budget and KV slots
              (ngram: drafts known now; draft model: k reserved)
    execute : [draft model proposes k tokens in the reserved slots]
              target forward over [last token, d1..dk] -> k + 1 rows of logits
              rejection sampler -> accepted drafts + one token
    update  : num_computed_tokens += 1 + accepted; rejected drafts' KV slots are
              simply not counted (overwritten by later tokens): the rollback

Modules: ``ngram`` and ``draft_model`` (the proposers). ``--speculative-config`` is parsed by
``pdserve.engine.speculative_config``; the verification is ``execution.rejection_sampler``, beside
the model runner that runs it.
"""

from pdserve.engine.speculative_config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
