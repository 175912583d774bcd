"""Byte-level BPE tokenizers: Meta's Llama 3 tiktoken file and a Hugging Face tokenizer.json.

Encoding is left to the libraries (tiktoken, tokenizers); this module reads the files, tells the
kinds apart by their contents and says which ids are bos/eos. For both kinds:
- encoding ordinary text never yields a special token (a "<|eot_id|>" typed in the text is encoded
  as the characters it is made of), and special tokens decode to nothing, as sentencepiece's do;
- unk_id is -1 unless a tokenizer.json names an unk token (every byte has an id: nothing is unknown);
- pad_id is -1 unless tokenizer_config.json names a pad token;
- id_to_piece gives a special token's name, else the token's text (tiktoken: its bytes as UTF-8,
  other bytes as \\xNN escapes; Hugging Face: the vocabulary's string, e.g. "Ġthe").
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from hybridpar.files import sha256_file, sha256_text

# Llama 3's pre-tokenizer split (Meta's tokenizer.py): contractions, letter runs with one leading
# non-letter, numbers of at most three digits, punctuation runs, newline runs, other whitespace.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL_TOKENS = 256
_NAMED_SPECIALS = {  # position after the BPE ranks -> name; the other positions are reserved ones
    0: "<|begin_of_text|>", 1: "<|end_of_text|>", 6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "<|eot_id|>",
}
# Hugging Face fallbacks when neither tokenizer_config.json nor the post-processor names them.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")
_RANK_LINE = re.compile(rb"[A-Za-z0-9+/]+=*[ \t]+[0-9]+\s*")
# A JSON object's opening; a bare "{" could also start a sentencepiece protobuf (a length byte).
_JSON_OBJECT = re.compile(rb'\s*\{\s*["}]')
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")  # looked for in this order in a folder


def llama3_special_tokens() -> list[str]:
    """Meta's 256 Llama 3 special tokens in id order (the first follows the last BPE rank)."""
    names, reserved = [], 0
    for position in range(LLAMA3_NUM_SPECIAL_TOKENS):
        if position in _NAMED_SPECIALS:
            names.append(_NAMED_SPECIALS[position])
        else:
            names.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return names


def detect_kind(path: Path) -> str:
    """"huggingface" (JSON), "tiktoken" (base64-token rank lines) or "sentencepiece" (anything else)."""
    with open(path, "rb") as f:
        head = f.read(1 << 12)
    if _JSON_OBJECT.match(head):
        return "huggingface"
    first_line = head.split(b"\n", 1)[0]
    return "tiktoken" if _RANK_LINE.fullmatch(first_line) else "sentencepiece"


def find_tokenizer_file(folder: Path) -> Path:
    """The tokenizer.model (Meta's original/, Llama 2 folders) or else tokenizer.json in a folder."""
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            return folder / name
    raise IsADirectoryError(
        f"tokenizer {folder} is a directory; pass the tokenizer.model file inside it, or a folder that holds "
        f"a tokenizer.model (sentencepiece or Meta's Llama 3 tiktoken file) or a Hugging Face tokenizer.json; "
        f"{folder} holds neither"
    )


def _without(ids: Sequence[int], dropped: set[int]) -> list[int]:
    return [int(i) for i in ids if int(i) not in dropped]


class TiktokenBPE:
    """Meta's Llama 3 tokenizer.model: BPE ranks, Llama 3's split pattern, 256 specials after them."""

    kind = "tiktoken"
    adds_bos = False  # Meta's tokenizer.py adds bos only when asked
    unk_id = pad_id = -1

    def __init__(self, path: Path) -> None:
        import tiktoken

        ranks = read_tiktoken_ranks(path)
        self.n_words = len(ranks)
        names = llama3_special_tokens()
        self.specials = {name: self.n_words + i for i, name in enumerate(names)}
        self._special_ids = set(self.specials.values())
        self._names = {i: name for name, i in self.specials.items()}
        self._enc = tiktoken.Encoding(name=path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=self.specials)
        self.vocab_size = self.n_words + len(names)
        self.bos_id, self.eos_id = self.specials["<|begin_of_text|>"], self.specials["<|end_of_text|>"]
        self.sha256 = sha256_file(path)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def encode_batch_numpy(self, texts: list[str], threads: Optional[int] = None) -> list[np.ndarray]:
        batch = self._enc.encode_ordinary_batch(texts, **({"num_threads": threads} if threads else {}))
        return [np.asarray(ids, dtype=np.int32) for ids in batch]

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(_without(ids, self._special_ids))

    def id_to_piece(self, token_id: int) -> str:
        if token_id in self._names:
            return self._names[token_id]
        return self._enc.decode_single_token_bytes(token_id).decode("utf-8", "backslashreplace")


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """`base64(token bytes) rank` lines -> {bytes: rank}; ranks must be 0..n-1 and cover every byte."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise ValueError(f"{path}:{lineno}: not a 'base64-token rank' line, as every line of a tiktoken "
                                 f"BPE file (Llama 3's tokenizer.model) is") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks of a tiktoken BPE file must be 0, 1, ..., n-1, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path}: no rank for the single bytes {missing[:5]} ({len(missing)} in all); "
                         f"a byte-level BPE file ranks all 256")
    return ranks


class HuggingFaceBPE:
    """A tokenizer.json through the `tokenizers` library; bos/eos/pad as hf_special_ids says."""

    kind = "huggingface"

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
            spec = json.loads(path.read_text(encoding="utf-8"))
        except Exception as e:  # the library raises a bare Exception for a malformed file
            raise ValueError(f"{path} is not a valid Hugging Face tokenizer.json ({e}); pass one the `tokenizers` "
                             f"library (or transformers' save_pretrained) wrote, or a tokenizer.model") from e
        self._tok.encode_special_tokens = True  # special tokens written in the text stay plain text
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        config_path = path.with_name("tokenizer_config.json")
        config = _read_json(config_path) if config_path.is_file() else {}
        self.bos_id, self.eos_id, self.pad_id = hf_special_ids(self._tok, spec, config)
        # transformers' default encoding adds what the post-processor's template puts first (Llama 3's
        # and 4's put <|begin_of_text|>): lm-eval's Hugging Face backend scores with it.
        first = _template_ends(spec.get("post_processor"))[0]
        self.adds_bos = self.bos_id >= 0 and self._id(first) == self.bos_id
        unk = (spec.get("model") or {}).get("unk_token")
        self.unk_id = self._id(unk)
        self.sha256 = hf_sha256(path, config)

    def _id(self, token: Optional[str]) -> int:
        found = self._tok.token_to_id(token) if token else None
        return -1 if found is None else found

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_batch_numpy(self, texts: list[str], threads: Optional[int] = None) -> list[np.ndarray]:
        # threads: TOKENIZERS_PARALLELISM / RAYON_NUM_THREADS, set by tokenizer.limit_threads
        return [np.asarray(ids, dtype=np.int32) for ids in self.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def id_to_piece(self, token_id: int) -> str:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise IndexError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        return piece


def hf_special_ids(tok, spec: dict, config: dict) -> tuple[int, int, int]:
    """(bos_id, eos_id, pad_id) of a Hugging Face tokenizer; -1 where none is found.

    Each is the first of these that names a token the tokenizer has:
    1. tokenizer_config.json beside the tokenizer.json: its bos_token / eos_token / pad_token;
    2. bos, eos: the special token that the post-processor's single-text template puts first / last
       (Llama 3's puts <|begin_of_text|> first and nothing last); BERT/RoBERTa's cls / sep;
    3. bos, eos: an added token named <|begin_of_text|>, <s>, <bos> / <|end_of_text|>, </s>,
       <|endoftext|>, <eos>, in that order.
    """
    first, last = _template_ends(spec.get("post_processor"))
    picks = []
    for key, template_token, names in (("bos_token", first, _BOS_NAMES), ("eos_token", last, _EOS_NAMES),
                                       ("pad_token", None, ())):
        candidates = [_config_token(config.get(key)), template_token, *names]
        ids = [tok.token_to_id(c) for c in candidates if c]
        picks.append(next((i for i in ids if i is not None), -1))
    return picks[0], picks[1], picks[2]


def _config_token(value) -> Optional[str]:
    """tokenizer_config.json writes a token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def _template_ends(processor: Optional[dict]) -> tuple[Optional[str], Optional[str]]:
    """The special tokens a post-processor adds before and after a single text, if any."""
    if not processor:
        return None, None
    kind = processor.get("type")
    if kind == "Sequence":
        ends = [_template_ends(p) for p in processor.get("processors") or []]
        return next((f for f, _ in ends if f), None), next((l for _, l in ends if l), None)
    if kind in ("BertProcessing", "RobertaProcessing"):
        return processor["cls"][0], processor["sep"][0]
    if kind == "TemplateProcessing":
        single = processor.get("single") or []
        names = [item["SpecialToken"]["id"] if "SpecialToken" in item else None for item in single]
        return (names[0], names[-1]) if names else (None, None)
    return None, None


def hf_sha256(path: Path, config: Optional[dict] = None) -> str:
    """A tokenizer.json's sha256, with its tokenizer_config.json's when that holds anything (`config`:
    that file as read, else it is read here): it can change bos/eos, and eos goes into token stores."""
    config_path = path.with_name("tokenizer_config.json")
    if config is None:
        config = _read_json(config_path) if config_path.is_file() else {}
    sha = sha256_file(path)
    return sha256_text(sha + sha256_file(config_path)) if config else sha


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or remove it (it names bos/eos/pad)") from None
