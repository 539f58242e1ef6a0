"""Structured outputs: constrain sampling to a grammar (JSON schema, regex, choice, Lark) with llguidance.

vLLM's design (its ``guidance`` backend), on llguidance (Moskal et al., guidance-ai/llguidance):
an Earley parser over a lexer, which computes the set of tokens that may come next as a
bitmask, one bit per tokenizer token.

    SamplingParams.structured_outputs ──grammar_spec──▶ (kind, spec, compact) ──llguidance──▶ grammar
        EngineCore.add_request: StructuredOutputManager.new_request ──▶ a pristine LLMatcher (cached,
            LRU by that key), deep-copied into the request's StructuredOutputRequest
        each step: ModelRunner builds the batch's token bitmask (build_token_bitmask); the sampler
            sets the logits of disallowed tokens to -inf after the raw logprobs, before sampling
        each sampled token: Request.append_token advances the request's matcher; once the
            grammar is complete (the matcher stopped) the request finishes with "stop"

Compiling is off the step loop, as vLLM does it. ``add_request`` first checks the grammar
without the tokenizer (``grammar_text``: llguidance's own validation, cached), so an invalid
one is a ``ValidationError`` at admission, which every caller turns into HTTP 400
(``ErrorKind.INVALID_REQUEST``) or ``ValueError`` before any KV block is taken. A grammar
already compiled is a cache hit plus a ``deep_copy`` (about 0.1 ms). Otherwise
``StructuredOutputManager.submit`` compiles it against the tokenizer on a background thread.
The first compile of an engine also loads llguidance's tokenizer and ``llguidance.torch``,
about 4.5 s on this CPU; a 770 KB schema takes about 0.9 s. The request waits in the queue
meanwhile (vLLM's ``WAITING_FOR_FSM``: the scheduler admits the requests behind it), while
the step loop goes on serving everyone else. A compile that still fails (a resource limit)
gives the request a ``FailedGrammar``, which ends it as an error at its first token.

Each of a request's ``n`` samples has its own matcher; samples 1..n-1 start where sample 0
started (a fresh copy of the compiled grammar, ``StructuredOutputRequest.fresh``). Preemption
keeps the output tokens, so the matcher state stays valid; a migrated (resumed) request replays
its output tokens into a fresh matcher; on the decode worker the first token, sampled under the
same grammar by the prefill worker, is replayed like any other token.

Token ids the model has but the tokenizer lacks (``vocab_size`` above the tokenizer's) are
never allowed under a grammar. Rows without a grammar are left untouched.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
import torch

from pdserve.common.protocol import StructuredOutputsParams
from pdserve.common.validation import ValidationError


GRAMMAR_CACHE_SIZE = 128  # grammars kept per cache (texts per process, compiled matchers per engine)
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
_KINDS = ("json", "json_object", "regex", "choice", "grammar")

GrammarKey = tuple[str, str, bool]  # (kind, spec text, compact JSON): the key of both grammar caches
# GrammarKey -> (grammar text, None) or (None, error), shared by the router's checks and the engines
_GRAMMAR_TEXTS: OrderedDict[GrammarKey, tuple[str | None, str | None]] = OrderedDict()
_cache_lock = threading.Lock()


def grammar_spec(params: StructuredOutputsParams) -> GrammarKey:
    """The one constraint ``params`` sets, as ``(kind, spec text, compact)``.

    ``kind`` is one of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``; ``spec`` is
    the schema text, regex, choice list as JSON text, or grammar text (``json_object``: the
    schema of any object); ``compact`` is ``disable_any_whitespace`` for JSON kinds.

    Raises:
        ValidationError: no constraint, or more than one (vLLM allows exactly one).
    """
    present = [k for k in _KINDS if (params.json_object if k == "json_object" else getattr(params, k) is not None)]
    if len(present) != 1:
        what = "none" if not present else ", ".join(present)
        raise ValidationError(f"structured outputs take exactly one constraint (json, json_object, regex, "
                              f"choice or grammar); got {what}", "structured_outputs")
    kind = present[0]
    compact = params.disable_any_whitespace and kind in ("json", "json_object")
    if kind == "json_object":
        return kind, _JSON_OBJECT_SCHEMA, compact
    if kind == "choice":
        if not params.choice:
            raise ValidationError("structured outputs: choice must list at least one string", "structured_outputs")
        return kind, json.dumps(params.choice), compact
    return kind, getattr(params, kind), compact


def _choice_lark(choices: list[str]) -> str:
    """A Lark grammar whose language is exactly ``choices`` (each a JSON-escaped string literal)."""
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def grammar_text(key: GrammarKey) -> str:
    """The llguidance grammar for ``key`` (from ``grammar_spec``), validated (cached, LRU).

    JSON allows any JSON whitespace between tokens unless compact (vLLM's default, and its
    ``disable_any_whitespace``); a schema may also set llguidance's options under
    ``"x-guidance"``. ``grammar`` is Lark syntax (llguidance's dialect; GBNF is converted).

    Raises:
        ValidationError: the schema, regex or grammar is invalid (llguidance's message).
    """
    grammar, error = _grammar_text_cached(key)
    if error is not None:
        raise ValidationError(f"invalid structured outputs {key[0]}: {error}", "structured_outputs")
    return grammar


def _grammar_text_cached(key: GrammarKey) -> tuple[str | None, str | None]:
    kind, spec, compact = key
    with _cache_lock:
        hit = _GRAMMAR_TEXTS.get(key)
        if hit is not None:
            _GRAMMAR_TEXTS.move_to_end(key)
            return hit
    try:
        if kind in ("json", "json_object"):
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": not compact})
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            grammar = llguidance.LLMatcher.grammar_from_lark(_choice_lark(json.loads(spec)))
        elif kind == "grammar":
            grammar = llguidance.grammar_from("grammar", spec)
        else:
            raise ValueError(f"unknown kind {kind!r}")
        error = llguidance.LLMatcher.validate_grammar(grammar) or None
    except (ValueError, TypeError) as e:
        grammar, error = None, str(e)
    result = (None, error.strip()) if error else (grammar, None)
    with _cache_lock:
        _GRAMMAR_TEXTS[key] = result
        while len(_GRAMMAR_TEXTS) > GRAMMAR_CACHE_SIZE:
            _GRAMMAR_TEXTS.popitem(last=False)
    return result


def check_structured_outputs(params: StructuredOutputsParams | None) -> None:
    """Raise ValidationError unless ``params`` is None or names exactly one valid constraint.

    No tokenizer needed (the router and ``LLM`` call this before any work); engines compile
    again against their tokenizer (``StructuredOutputManager.new_request``).
    """
    if params is not None:
        grammar_text(grammar_spec(params))


class StructuredOutputRequest:
    """One sample's grammar state: an llguidance ``LLMatcher`` advanced with each output token.

    Every method is cheap (microseconds); none raises for a token the grammar rejects: the
    matcher then enters its error state (``error`` says why) and the request is finished as an
    error by ``Request.append_token``. The methods named for speculative decoding
    (``validate_tokens``, ``accept_tokens``, ``rollback``) are llguidance's.
    """

    def __init__(self, manager: StructuredOutputManager, key: GrammarKey, matcher: llguidance.LLMatcher):
        self.manager = manager
        self.key = key
        self.matcher = matcher

    def fresh(self) -> StructuredOutputRequest:
        """A new state for the same grammar, at its start (another sample of the same prompt)."""
        return self.manager.new_matcher(self.key)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (and the error state) if the grammar rejects one."""
        return self.matcher.consume_tokens(token_ids)

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of ``token_ids`` the grammar accepts from here (state unchanged)."""
        return self.matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens.

        Raises:
            ValueError: fewer than ``num_tokens`` tokens were accepted.
        """
        if not self.matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll the grammar back by {num_tokens} tokens: {self.matcher.get_error()}")

    def is_terminated(self) -> bool:
        """The grammar is complete and admits no further token (only EOS): the output is done."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def error(self) -> str | None:
        """Why the matcher is in its error state (a rejected token, a resource limit), or None."""
        return (self.matcher.get_error() or "error") if self.matcher.is_error() else None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``.

        Args:
            bitmask: [num_rows, num_words] int32 on the CPU, ``num_words >= ceil(tokenizer_vocab / 32)``;
                bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed. Words and bits past the
                tokenizer's vocabulary are cleared (ids the tokenizer lacks are never allowed).
        """
        import llguidance.torch  # imported on first use: it sets up torch.compile (a second at start-up)

        num_words = self.manager.num_bitmask_words
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask[:, :num_words], row)
        bitmask[row, num_words:] = 0
        tail = self.manager.tokenizer_vocab_size % 32
        if tail:
            bitmask[row, num_words - 1] &= (1 << tail) - 1


class FailedGrammar:
    """A grammar whose compile failed on the background thread: the request it belongs to ends as an
    error at its first token (``Request.append_token``), with this ``error``. Masks allow every token."""

    def __init__(self, manager: StructuredOutputManager, error: str):
        self.manager = manager
        self.error = f"could not compile the structured outputs grammar: {error}"

    def fresh(self) -> FailedGrammar:
        return self

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return False

    def validate_tokens(self, token_ids: list[int]) -> int:
        return 0

    def rollback(self, num_tokens: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        pass  # every bit stays set


class StructuredOutputManager:
    """One engine's structured outputs: the served model's tokenizer for llguidance and a cache of
    compiled grammars.

    Args:
        model_dir: the checkpoint directory; its Hugging Face (fast) tokenizer is loaded on the first
            constrained request (engines that never see one pay nothing).
        eos_token_ids: the engine's EOS ids; the grammar allows them where it may end.
        cache_size: compiled grammars kept (LRU), keyed by ``grammar_spec``'s key.
    """

    def __init__(self, model_dir: str, eos_token_ids: frozenset[int] = frozenset(),
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self.model_dir = model_dir
        self.eos_token_ids = eos_token_ids
        self.cache_size = cache_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[GrammarKey, llguidance.LLMatcher] = OrderedDict()
        self.num_compiles = 0  # cache misses (grammars compiled against the tokenizer)
        self._lock = threading.RLock()  # the tokenizer and the cache: the step loop and the compile thread
        self._executor: ThreadPoolExecutor | None = None  # started by the first compile

    def submit(self, params: StructuredOutputsParams) -> StructuredOutputRequest | Future:
        """A state for ``params``' grammar now if it is compiled, else a Future of one (compiled on a
        background thread, never on the step loop).

        Raises:
            ValidationError: no or several constraints, or an invalid schema / regex / grammar
                (checked here, without the tokenizer).
        """
        key = grammar_spec(params)
        grammar_text(key)  # syntax: fails now, at admission
        with self._lock:
            pristine = self._compiled.get(key)
            if pristine is not None:
                self._compiled.move_to_end(key)
                return StructuredOutputRequest(self, key, pristine.deep_copy())
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-grammar")
        return self._executor.submit(self._compile, key)

    def _compile(self, key: GrammarKey) -> StructuredOutputRequest | FailedGrammar:
        """The compile thread's job; never raises (a failure becomes a ``FailedGrammar``)."""
        try:
            import llguidance.torch  # noqa: F401  here, not on the step loop at the first mask (~1.5 s)

            return self.new_matcher(key)
        except Exception as e:  # noqa: BLE001  reported through the request, never lost in the thread
            return FailedGrammar(self, str(getattr(e, "message", e)))

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the model's tokenizer (built once; about a second for a large vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def _load_tokenizer(self) -> llguidance.LLTokenizer:
        from transformers import AutoTokenizer

        hf_tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        vocab_size = len(hf_tokenizer)
        eos = sorted(t for t in self.eos_token_ids if t < vocab_size) or None
        try:
            return llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=eos)
        except ValueError as e:  # a slow (Python) tokenizer
            raise ValidationError(f"structured outputs need a fast tokenizer: {e}", "structured_outputs") from e

    @property
    def tokenizer_vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def num_bitmask_words(self) -> int:
        """32-bit words of one row of the tokenizer's mask."""
        return (self.tokenizer_vocab_size + 31) // 32

    def new_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """A state at the start of the grammar ``params`` names (compiled now, or copied from the cache).

        Raises:
            ValidationError: no or several constraints, or an invalid schema / regex / grammar.
        """
        return self.new_matcher(grammar_spec(params))

    def new_matcher(self, key: GrammarKey) -> StructuredOutputRequest:
        """A fresh state for the grammar of ``key`` (``grammar_spec``'s)."""
        with self._lock:
            pristine = self._compiled.get(key)
            if pristine is not None:
                self._compiled.move_to_end(key)
                return StructuredOutputRequest(self, key, pristine.deep_copy())
        pristine = llguidance.LLMatcher(self.tokenizer, grammar_text(key), log_level=0)
        if pristine.is_error():
            raise ValidationError(f"invalid structured outputs {key[0]}: {pristine.get_error()}",
                                  "structured_outputs")
        with self._lock:
            self.num_compiles += 1
            self._compiled[key] = pristine
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return StructuredOutputRequest(self, key, pristine.deep_copy())


def build_token_bitmask(states: list[StructuredOutputRequest | None], vocab_size: int) -> torch.Tensor | None:
    """The batch's allowed-token bitmask, or None when no row has a grammar.

    Args:
        states: one per logits row; None for a row without a grammar.
        vocab_size: the model's vocabulary (logits columns).

    Returns:
        [num_rows, num_words] int32 on the CPU with ``num_words >= ceil(vocab_size / 32)``: bit ``t % 32``
        of word ``t // 32`` set = token ``t`` allowed. Rows without a grammar allow everything.
    """
    constrained = [(i, s) for i, s in enumerate(states) if s is not None]
    if not constrained:
        return None
    bitmask = allocate_token_bitmask(len(states), vocab_size, constrained[0][1].manager)
    for row, state in constrained:
        state.fill_bitmask(bitmask, row)
    return bitmask


def allocate_token_bitmask(num_rows: int, vocab_size: int, manager: StructuredOutputManager) -> torch.Tensor:
    """[num_rows, num_words] int32 with every bit set (every token allowed), wide enough for the
    model's ``vocab_size`` and the tokenizer's vocabulary; rows are then filled per grammar state."""
    import llguidance.torch

    num_words = max((vocab_size + 31) // 32, manager.num_bitmask_words)
    return llguidance.torch.allocate_token_bitmask(num_rows, num_words * 32)
