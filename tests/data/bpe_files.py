"""Byte-level BPE tokenizer files made by the tests themselves: a tokenizer.json trained with the
`tokenizers` library (Llama 3's split, then bytes as characters) and the same BPE written out as a
tiktoken file (`base64(token bytes) rank` per line, rank = the trained id)."""

import base64
import itertools
import json
from pathlib import Path

from hybridpar.data.bpe import LLAMA3_PATTERN, llama3_special_tokens

MIXED_TEXT = (
    "Plain words, then numbers 1234567 and 3.14159; naïve café, 東京タワー, Ελληνικά, emoji 🙂👍🏽.\n"
    "def f(x):\n    return {'a': x ** 2}  # a comment\n\n\n\tTabbed\r\nwindows line\n"
    "    indented    runs     of  spaces   \n\n"
    "Contractions: it's, we'll, they're, I'd, YOU'VE.\n<not special> <|eot_id|> typed as text\n"
)


def byte_characters() -> dict[str, int]:
    """The byte-level alphabet's character for each byte -> that byte (printable bytes stand for
    themselves, the others take the characters from U+0100 on, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def train_hf_bpe(texts: list[str], vocab_size: int):
    """A Llama 3-style byte-level BPE trained on texts, with Llama 3's 256 special tokens added after
    it and a post-processor that puts <|begin_of_text|> first."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    n_words = tok.get_vocab_size()
    tok.add_special_tokens(llama3_special_tokens())
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", n_words)])
    return tok, n_words


def write_tiktoken_file(hf_tokenizer, path: Path) -> int:
    """The BPE vocabulary (without added tokens) as a tiktoken file; returns the number of ranks."""
    to_byte = byte_characters()
    vocab = hf_tokenizer.get_vocab(with_added_tokens=False)
    ranks = {bytes(to_byte[c] for c in piece): i for piece, i in vocab.items()}
    write_ranks(ranks, path)
    return len(ranks)


def write_ranks(ranks: dict[bytes, int], path: Path) -> None:
    lines = (f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda t: t[1]))
    path.write_text("".join(lines))


def write_wide_tiktoken_file(path: Path) -> int:
    """Every byte and every pair of bytes: 65,792 ranks, so bos/eos (and vocab_size) pass 65,535."""
    pairs = (bytes(p) for p in itertools.product(range(256), repeat=2))
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update((pair, 256 + i) for i, pair in enumerate(pairs))
    write_ranks(ranks, path)
    return len(ranks)


def write_tokenizer_config(folder: Path, **tokens) -> Path:
    """A tokenizer_config.json naming bos_token / eos_token / pad_token, as Hugging Face repos ship."""
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({key: {"content": value} for key, value in tokens.items()}))
    return path
