"""Deterministic synthetic training text, and the byte-level BPE tokenizer trained on it.

No data can be downloaded, so the BPE tokenizers behind the tiny checkpoints are
trained on text generated here from a seeded ``random.Random``: an invented
lexicon built from syllables (Zipf-distributed, so BPE has frequent and rare
words to merge), mixed with English function words, numbers, punctuation,
code-like and JSON-like lines, and non-ASCII words so multi-byte UTF-8 is
exercised. The same ``(seed, n_lines, lexicon_size)`` always yields the same
lines, on every platform and Python version (only ``random.Random`` integer and
``random()`` draws are used, whose streams are stable).

Tokenizer conventions: special tokens ``<s>``=0 (bos), ``</s>``=1 (eos),
``<pad>``=2, ``<|im_start|>``=3, ``<|im_end|>``=4; no normalizer and no added
prefix space, so ``decode(encode(text)) == text``; BOS/EOS are never added
automatically; the chat template is ChatML-like and adds no BOS.
"""

from __future__ import annotations

import bisect
import itertools
import random

__all__ = [
    "FUNCTION_WORDS", "NON_ASCII_WORDS", "make_lexicon", "generate_corpus", "sample_prompt",
    "BOS_TOKEN", "EOS_TOKEN", "PAD_TOKEN", "IM_START", "IM_END", "SPECIAL_TOKENS", "CHAT_TEMPLATE",
    "train_bpe_tokenizer", "train_bpe_on_texts", "tokenizer_config_files",
]

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START, IM_END = "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START, IM_END]  # ids 0..4 in this order

# ChatML-like. `content` may be a string, None, or a list of OpenAI-style parts.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- elif message['content'] is none %}{%- set content = '' %}"
    "{%- else %}{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_ONSETS = ["", "b", "br", "c", "ch", "d", "dr", "f", "fl", "g", "gr", "h", "j", "k", "kl", "l",
           "m", "n", "p", "pl", "qu", "r", "s", "sh", "sk", "st", "t", "th", "tr", "v", "w", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "ou", "oo", "y", "ie"]
_CODAS = ["", "", "", "n", "r", "s", "l", "t", "m", "nd", "st", "ck", "ng", "x"]

FUNCTION_WORDS = [
    "the", "a", "an", "of", "and", "to", "in", "is", "that", "it", "for", "on", "with", "as",
    "was", "by", "at", "from", "this", "be", "or", "are", "not", "but", "have", "we", "they",
    "you", "can", "will", "all", "there", "which", "one", "when", "what", "their", "if", "more",
]

NON_ASCII_WORDS = [
    "café", "naïve", "jalapeño", "façade", "über", "smörgåsbord", "crème", "brûlée", "déjà",
    "vu", "Zürich", "São", "Paulo", "Ελλάδα", "λόγος", "привет", "мир", "日本", "東京", "中文",
    "漢字", "한국어", "مرحبا", "שלום", "हिन्दी", "😀", "🚀", "—", "…", "€", "°C", "×", "ß",
]

_CODE_NAMES = ["x", "y", "i", "n", "buf", "key", "val", "node", "item", "self", "cfg", "ctx"]
_KEYWORDS = ["def", "return", "for", "if", "else", "while", "import", "class", "yield", "with"]


def _make_word(rng: random.Random) -> str:
    n_syl = rng.choice([1, 2, 2, 2, 3, 3, 4])
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n_syl))


def make_lexicon(rng: random.Random, size: int) -> list[str]:
    """Return ``size`` distinct invented words (letters only), in generation order."""
    seen: set[str] = set(FUNCTION_WORDS)
    words: list[str] = []
    while len(words) < size:
        w = _make_word(rng)
        if len(w) >= 2 and w not in seen:
            seen.add(w)
            words.append(w)
    return words


class _Vocab:
    """Zipf-weighted word sampler over function words + invented lexicon."""

    def __init__(self, rng: random.Random, lexicon_size: int) -> None:
        self.words = FUNCTION_WORDS + make_lexicon(rng, lexicon_size)
        self.cum = list(itertools.accumulate(1.0 / (r + 2) for r in range(len(self.words))))

    def word(self, rng: random.Random) -> str:
        i = bisect.bisect_right(self.cum, rng.random() * self.cum[-1])
        return self.words[min(i, len(self.words) - 1)]


def _number(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return str(rng.randrange(10))
    if kind == 1:
        return str(rng.randrange(1000, 2100))
    if kind == 2:
        return f"{rng.randrange(1, 1000)},{rng.randrange(1000):03d}"
    if kind == 3:
        return f"{rng.randrange(100)}.{rng.randrange(100):02d}"
    if kind == 4:
        return f"{rng.randrange(101)}%"
    return str(rng.randrange(10 ** rng.randrange(2, 9)))


def _sentence(rng: random.Random, vocab: _Vocab, non_ascii: bool = False) -> str:
    words = []
    for _ in range(rng.randrange(4, 16)):
        r = rng.random()
        if non_ascii and r < 0.25:
            words.append(rng.choice(NON_ASCII_WORDS))
        elif r < 0.06:
            words.append(_number(rng))
        else:
            words.append(vocab.word(rng))
        if rng.random() < 0.08:
            words[-1] += rng.choice([",", ",", ";", ":"])
    words[0] = words[0][:1].upper() + words[0][1:]
    if rng.random() < 0.1:
        i = rng.randrange(len(words))
        words[i] = rng.choice(['"', "(", "'"]) + words[i] + rng.choice(['"', ")", "'"])
    return " ".join(words) + rng.choice([".", ".", ".", "?", "!"])


def _code_line(rng: random.Random, vocab: _Vocab) -> str:
    name = vocab.word(rng) + "_" + vocab.word(rng)
    a, b = rng.choice(_CODE_NAMES), rng.choice(_CODE_NAMES)
    kind = rng.randrange(8)
    if kind == 0:
        return f"def {name}({a}, {b}={rng.randrange(10)}):"
    if kind == 1:
        return f"    return {a} + {b} * {rng.randrange(100)}"
    if kind == 2:
        return f"for {a} in range({rng.randrange(1, 64)}):"
    if kind == 3:
        return f"    if {a} == {b}:\n        {name}.append({a})"
    if kind == 4:
        return f"if ({a} != {b}) {{ {a}[{rng.randrange(8)}] += {b}; }}"
    if kind == 5:
        return f"import {vocab.word(rng)}.{vocab.word(rng)} as {a}"
    if kind == 6:
        return f"{name} = {{'{a}': {rng.randrange(1000)}, '{b}': [{rng.randrange(9)}, {rng.randrange(9)}]}}"
    return f"# {rng.choice(_KEYWORDS)} {vocab.word(rng)} {vocab.word(rng)} -> {name}()"


def _json_line(rng: random.Random, vocab: _Vocab) -> str:
    tags = ", ".join(f'"{vocab.word(rng)}"' for _ in range(rng.randrange(0, 4)))
    ok = rng.choice(["true", "false", "null"])
    return (f'{{"id": {rng.randrange(100000)}, "name": "{vocab.word(rng)}", '
            f'"score": {rng.randrange(100)}.{rng.randrange(10)}, "tags": [{tags}], "ok": {ok}}}')


def generate_corpus(seed: int = 0, n_lines: int = 4000, lexicon_size: int = 1500) -> list[str]:
    """Return ``n_lines`` deterministic lines of mixed prose/numbers/code/JSON/non-ASCII text."""
    rng = random.Random(seed)
    vocab = _Vocab(rng, lexicon_size)
    lines = []
    for _ in range(n_lines):
        r = rng.random()
        if r < 0.62:
            line = " ".join(_sentence(rng, vocab) for _ in range(rng.randrange(1, 4)))
        elif r < 0.74:
            line = _sentence(rng, vocab, non_ascii=True)
        elif r < 0.88:
            line = _code_line(rng, vocab)
        else:
            line = _json_line(rng, vocab)
        lines.append(line)
    # Make sure every rare non-ASCII word appears a few times in whole form.
    lines.extend(" ".join(NON_ASCII_WORDS[i:] + NON_ASCII_WORDS[:i]) for i in range(0, len(NON_ASCII_WORDS), 3))
    return lines


def sample_prompt(seed: int, n_sentences: int = 3, lexicon_size: int = 1500) -> str:
    """A deterministic prose prompt drawn from the same distribution (handy for tests/benchmarks)."""
    rng = random.Random(seed)
    vocab = _Vocab(random.Random(0), lexicon_size)
    return " ".join(_sentence(rng, vocab) for _ in range(n_sentences))


def train_bpe_tokenizer(vocab_size: int, n_lines: int = 4000, lexicon_size: int = 1500, seed: int = 0):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` of exactly ``vocab_size`` tokens on
    :func:`generate_corpus` text. Deterministic (also across processes); raises if the corpus is
    too small to reach ``vocab_size``."""
    lines = generate_corpus(seed=seed, n_lines=n_lines, lexicon_size=lexicon_size)
    return train_bpe_on_texts(lines, vocab_size)


def train_bpe_on_texts(texts: list[str], vocab_size: int):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` of exactly ``vocab_size`` tokens on ``texts``.

    Same conventions as every pdserve tokenizer: :data:`SPECIAL_TOKENS` take ids 0..4, all 256 byte
    symbols are in the vocabulary, no normalizer and no prefix space (``decode(encode(t)) == t``).
    Deterministic for the same texts (also across processes).

    Raises:
        RuntimeError: the texts are too small to reach ``vocab_size``, or a special token did not
            get its id.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE reached {tok.get_vocab_size()} tokens, wanted {vocab_size}; "
                           "use more corpus lines / a larger lexicon")
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t!r} got id {tok.token_to_id(t)}, expected {i}")
    return tok


def tokenizer_config_files(model_max_length: int) -> tuple[dict, dict]:
    """Contents of ``tokenizer_config.json`` and ``special_tokens_map.json`` for a tokenizer from
    :func:`train_bpe_tokenizer` (loadable by ``AutoTokenizer`` in transformers 4.x and 5.x)."""
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
                   "additional_special_tokens": [IM_START, IM_END]}
    return tok_cfg, special_map
