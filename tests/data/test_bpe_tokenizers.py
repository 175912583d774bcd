"""Llama 3's tiktoken tokenizer.model and Hugging Face tokenizer.json, on files the tests make:
ids equal the libraries' own, exact round trips, bos/eos, kind from the contents, folders, errors."""

import json
import pickle

import numpy as np
import pytest

from hybridpar.data import Tokenizer
from hybridpar.data.bpe import LLAMA3_PATTERN, llama3_special_tokens
from tests.data.bpe_files import MIXED_TEXT, write_tokenizer_config, write_wide_tiktoken_file

TEXTS = [MIXED_TEXT, "", " ", "\n\n", "x" * 300, "  leading and trailing  ", "1 22 333 4444 55555", "🙂" * 5]


def compare(name, ours, theirs):
    """Count and print the ids compared and the mismatches; return the mismatches."""
    compared = sum(len(ids) for ids in theirs)
    mismatches = sum(a != b for x, y in zip(ours, theirs) for a, b in zip(x, y))
    mismatches += sum(abs(len(x) - len(y)) for x, y in zip(ours, theirs))
    print(f"{name}: {compared} ids compared over {len(theirs)} texts, {mismatches} mismatches")
    return mismatches


def test_tiktoken_ids_equal_tiktokens_own(tiktoken_tokenizer, bpe_files, corpus_sample):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    n_words = bpe_files[2]
    specials = {name: n_words + i for i, name in enumerate(llama3_special_tokens())}
    reference = tiktoken.Encoding("reference", pat_str=LLAMA3_PATTERN, special_tokens=specials,
                                  mergeable_ranks=load_tiktoken_bpe(str(bpe_files[1])))
    texts = TEXTS + corpus_sample[150:250]
    theirs = [reference.encode(t, disallowed_special=()) for t in texts]
    assert compare("tiktoken", tiktoken_tokenizer.encode_batch(texts), theirs) == 0
    assert [tiktoken_tokenizer.encode(t) for t in texts] == theirs
    assert [a.tolist() for a in tiktoken_tokenizer.encode_batch_numpy(texts)] == theirs
    assert all(tiktoken_tokenizer.decode(ids) == t for ids, t in zip(theirs, texts))


def test_tiktoken_llama3_special_ids(tiktoken_tokenizer, bpe_files):
    tok, n_words = tiktoken_tokenizer, bpe_files[2]
    assert tok.kind == "tiktoken" and tok.vocab_size == n_words + 256
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) == (n_words, n_words + 1, -1, -1)
    names = {5: "<|reserved_special_token_3|>", 6: "<|start_header_id|>", 7: "<|end_header_id|>",
             8: "<|reserved_special_token_4|>", 9: "<|eot_id|>", 10: "<|reserved_special_token_5|>",
             255: "<|reserved_special_token_250|>"}
    assert {i: tok.id_to_piece(n_words + i) for i in names} == names
    ids = tok.encode("hello <|eot_id|> <|begin_of_text|>", bos=True, eos=True)
    assert ids[0] == n_words and ids[-1] == n_words + 1 and all(i < n_words for i in ids[1:-1])
    assert tok.decode(ids) == "hello <|eot_id|> <|begin_of_text|>"  # typed specials are text, bos/eos vanish
    assert tok.id_to_piece(tok.encode("A")[0]) == "A"


def test_hf_ids_equal_the_librarys_own(hf_tokenizer, bpe_files, corpus_sample):
    from tokenizers import Tokenizer as HFTokenizer

    reference = HFTokenizer.from_file(str(bpe_files[0]))
    texts = TEXTS[:-1] + corpus_sample[150:250]  # not the special token typed as text (tested below)
    texts[0] = MIXED_TEXT.replace("<|eot_id|>", "")
    theirs = [reference.encode(t, add_special_tokens=False).ids for t in texts]
    assert compare("tokenizer.json", hf_tokenizer.encode_batch(texts), theirs) == 0
    assert [a.tolist() for a in hf_tokenizer.encode_batch_numpy(texts)] == theirs
    assert all(hf_tokenizer.decode(ids) == t for ids, t in zip(theirs, texts))
    assert hf_tokenizer.decode(hf_tokenizer.encode(MIXED_TEXT)) == MIXED_TEXT


def test_hf_special_ids_and_the_config_beside_it(hf_tokenizer, bpe_files, tmp_path):
    n_words = bpe_files[2]
    tok = hf_tokenizer
    assert tok.kind == "huggingface" and tok.vocab_size == n_words + 256
    # bos from the post-processor's template, eos by its name, no unk/pad named.
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) == (n_words, n_words + 1, -1, -1)
    ids = tok.encode("a <|eot_id|>", bos=True, eos=True)
    assert ids[0] == n_words and ids[-1] == n_words + 1 and all(i < n_words for i in ids[1:-1])
    assert tok.id_to_piece(n_words + 9) == "<|eot_id|>" and tok.id_to_piece(tok.encode(" the")[0]).startswith("Ġ")

    copy = tmp_path / "tokenizer.json"
    copy.write_bytes(bpe_files[0].read_bytes())
    write_tokenizer_config(tmp_path, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                           pad_token="<|reserved_special_token_0|>")
    configured = Tokenizer(copy)
    assert (configured.bos_id, configured.eos_id, configured.pad_id) == (n_words, n_words + 9, n_words + 2)
    assert configured.sha256 != tok.sha256  # the config changes eos, so token files must not be shared


def test_adds_bos_says_what_the_tokenizers_own_encoding_puts_first(hf_tokenizer, tiktoken_tokenizer, tokenizer,
                                                                   bpe_files, tmp_path):
    """A tokenizer.json whose post-processor puts bos first (Llama 3's and 4's) adds it, as the `tokenizers`
    library's default encoding does; without that post-processor, and sentencepiece and tiktoken files, not."""
    from tokenizers import Tokenizer as Library

    assert hf_tokenizer.adds_bos and not tiktoken_tokenizer.adds_bos and not tokenizer.adds_bos
    assert Library.from_file(str(bpe_files[0])).encode("a").ids[0] == hf_tokenizer.bos_id
    spec = json.loads(bpe_files[0].read_text())
    spec["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    assert not Tokenizer(tmp_path / "tokenizer.json").adds_bos
    assert Library.from_file(str(tmp_path / "tokenizer.json")).encode("a").ids[0] != hf_tokenizer.bos_id


def test_kind_comes_from_the_contents_not_the_name(bpe_files, tokenizer, tmp_path):
    hf_path, tiktoken_path, _ = bpe_files
    for source, name, kind in [(tiktoken_path, "tokenizer.json", "tiktoken"), (hf_path, "tokenizer.model", "huggingface"),
                               (tokenizer.path, "vocab.json", "sentencepiece")]:
        misnamed = tmp_path / kind / name
        misnamed.parent.mkdir()
        misnamed.write_bytes(source.read_bytes())
        loaded = Tokenizer(misnamed)
        assert loaded.kind == kind and loaded.encode(MIXED_TEXT) == Tokenizer(source).encode(MIXED_TEXT)


def test_a_folder_finds_its_tokenizer(bpe_files, tokenizer, tmp_path):
    hf_path, tiktoken_path, _ = bpe_files
    assert Tokenizer(tiktoken_path.parent).path == tiktoken_path  # Meta's original/
    assert Tokenizer(hf_path.parent).kind == "huggingface"  # a Hugging Face folder
    both = tmp_path / "both"
    both.mkdir()
    (both / "tokenizer.json").write_bytes(hf_path.read_bytes())
    (both / "tokenizer.model").write_bytes(tokenizer.path.read_bytes())
    assert Tokenizer(both).kind == "sentencepiece"  # tokenizer.model first, as in Llama 2's folders
    (tmp_path / "empty").mkdir()
    with pytest.raises(IsADirectoryError, match=r"tokenizer.json.*empty holds neither"):
        Tokenizer(tmp_path / "empty")


def test_unreadable_files_say_what_is_accepted(tmp_path):
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=r"not a valid sentencepiece model .*nor a tiktoken BPE file .*tokenizer.json"):
        Tokenizer(garbage)
    protobuf_like = tmp_path / "brace.model"
    protobuf_like.write_bytes(b"\n{\n\x05<unk>")  # a "{" that is a length byte, not JSON
    with pytest.raises(ValueError, match="brace.model is not a valid sentencepiece model"):
        Tokenizer(protobuf_like)
    bad_json = tmp_path / "tokenizer.json"
    bad_json.write_text('{"model": ')
    with pytest.raises(ValueError, match="is not a valid Hugging Face tokenizer.json"):
        Tokenizer(bad_json)
    bad_rank = tmp_path / "ranks.model"
    bad_rank.write_text("IQ== 0\nIg== x\n")
    with pytest.raises(ValueError, match=r"ranks.model:2: not a 'base64-token rank' line"):
        Tokenizer(bad_rank)
    few_bytes = tmp_path / "few.model"
    few_bytes.write_text("IQ== 0\nIg== 1\n")
    with pytest.raises(ValueError, match=r"no rank for the single bytes \[0, 1, 2, 3, 4\] \(254 in all\)"):
        Tokenizer(few_bytes)


@pytest.mark.parametrize("which", ["tiktoken", "huggingface"])
def test_pickles_by_path(which, tiktoken_tokenizer, hf_tokenizer):
    tok = tiktoken_tokenizer if which == "tiktoken" else hf_tokenizer
    copy = pickle.loads(pickle.dumps(tok))
    assert (copy.path, copy.kind, copy.sha256, copy.eos_id) == (tok.path, tok.kind, tok.sha256, tok.eos_id)
    assert copy.encode(MIXED_TEXT) == tok.encode(MIXED_TEXT)


def test_decode_accepts_arrays(tiktoken_tokenizer):
    ids = tiktoken_tokenizer.encode("some text to decode", bos=True)
    assert tiktoken_tokenizer.decode(np.array(ids, dtype=np.uint32)) == "some text to decode"


def test_wide_vocabulary(tmp_path):
    n_words = write_wide_tiktoken_file(tmp_path / "wide.model")
    tok = Tokenizer(tmp_path / "wide.model")
    assert (n_words, tok.vocab_size, tok.bos_id, tok.eos_id) == (65_792, 66_048, 65_792, 65_793)
    assert tok.decode(tok.encode(MIXED_TEXT)) == MIXED_TEXT
