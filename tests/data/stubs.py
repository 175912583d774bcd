"""Tokenizer stand-ins whose ids are known in advance, for tests of packing and loading."""

from pathlib import Path

from hybridpar.data import prepare_store


class NumberTokenizer:
    """Text of whitespace-separated integers -> those integers; enough of the Tokenizer interface for prepare."""

    def __init__(self, vocab_size: int = 1000, eos_id: int = 0) -> None:
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.sha256 = f"number-tokenizer-{vocab_size}-{eos_id}"
        self.path = Path("number-tokenizer")

    def encode_batch(self, texts):
        return [[int(word) for word in text.split()] for text in texts]


def numbered_token_file(folder: Path, n_tokens: int, name: str = "numbers"):
    """A token store holding 1, 2, ..., n_tokens - 1 and then EOS (0): token k sits at position k - 1."""
    text_path = folder / f"{name}.txt"
    text_path.write_text(" ".join(str(i) for i in range(1, n_tokens)))
    return prepare_store(text_path, NumberTokenizer(vocab_size=max(n_tokens, 2)), folder / name, workers=1,
                         report=False)


class SlowNumberTokenizer(NumberTokenizer):
    """NumberTokenizer taking `seconds` a batch: a unit that lasts, to watch from outside."""

    def __init__(self, seconds: float, vocab_size: int = 1000) -> None:
        super().__init__(vocab_size)
        self.seconds = seconds
        self.sha256 = f"slow-number-tokenizer-{vocab_size}"

    def encode_batch(self, texts):
        import time

        time.sleep(self.seconds)
        return super().encode_batch(texts)
