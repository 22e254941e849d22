"""Incremental detokenisation (issue 21, item 6): every tokenizer's stream, token by token and then flushed,
concatenates to ``decode`` of all the ids, never emitting half a character: byte-level BPE (the embedded
family's construction, and the built family itself when it is cached), a Llama-style BPE with byte-fallback
tokens, added and special tokens, and the byte tokenizer of the tiny models."""
import random

import pytest

from cluster.models.tokenizer import HFTokenizer
from tests.support.tokenizers import TEXTS, build_tokenizers


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return build_tokenizers(tmp_path_factory.mktemp("tok"))


def _streamed(tokenizer, ids):
    stream = tokenizer.stream()
    pieces = [stream.step(i) for i in ids]
    return pieces, stream.flush()


def _id_sequences(tok, rng):
    special = [i for i in (tok.eos_token_id, getattr(getattr(tok, "tok", None), "unk_token_id", None)) if i is not None]
    if isinstance(tok, HFTokenizer):
        special += tok.tok.convert_tokens_to_ids(["<tool>", " ||", "<|im_end|>"]) if "<tool>" in tok.tok.get_vocab() else []
    for text in TEXTS:
        ids = tok.encode(text)
        yield ids
        yield ids[: len(ids) // 2 + 1]                     # may end inside a character
        cut = list(ids)
        for at in sorted(rng.sample(range(len(cut)), 3), reverse=True):
            cut.insert(at, rng.choice(special))
        yield cut
    for _ in range(60):                                    # arbitrary ids: invalid UTF-8 mid-stream too
        yield [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]


def _subsequence(short, long):
    it = iter(long)
    return all(c in it for c in short)


@pytest.mark.parametrize("name", ["byte", "byte_level", "byte_fallback", "family"])
def test_stream_concatenates_to_decode(tokenizers, name):
    if name not in tokenizers:
        pytest.skip("the embedded family is not built (specserve zoo build)")
    tok, rng = tokenizers[name], random.Random(0)
    for ids in _id_sequences(tok, rng):
        pieces, tail = _streamed(tok, ids)
        full, streamed = tok.decode(ids), "".join(pieces) + tail
        if name == "byte_fallback" and "\ufffd" in full:
            # ByteFallback is not local: decode turns a whole run of byte tokens that is not valid UTF-8 into
            # U+FFFD per byte, characters the stream has already emitted included; those stay streamed
            assert _subsequence(full.replace("\ufffd", ""), streamed.replace("\ufffd", "")), (ids, streamed)
            assert len(streamed) <= len(full)
        else:
            assert streamed == full, (name, ids)
    for text in TEXTS:                                     # valid text: no piece ever holds half a character
        ids = tok.encode(text)
        pieces, tail = _streamed(tok, ids)
        assert "".join(pieces) == tok.decode(ids) == text and tail == ""
        assert not any("\ufffd" in p for p in pieces)
        assert sum(1 for p in pieces if p) > len(text) // 8          # incremental, not all at the end


def test_byte_fallback_holds_partial_characters(tokenizers):
    """A CJK character as three byte-fallback tokens: nothing, nothing, then the whole character."""
    tok = tokenizers["byte_fallback"]
    ids = tok.tok.convert_tokens_to_ids(["<0xE7>", "<0x8C>", "<0xAB>"])
    assert tok.encode("猫") == tok.tok.convert_tokens_to_ids(["▁"]) + ids       # not in the vocabulary
    assert _streamed(tok, ids) == (["", "", "猫"], "")
    assert _streamed(tok, ids[:2]) == (["", ""], tok.decode(ids[:2]))          # flushed as decode does
    cat, bad = tok.tok.convert_tokens_to_ids(["▁cat", "<0xE7>"])
    pieces, tail = _streamed(tok, [cat] + ids + [bad, cat])          # DecodeStream raises on this one
    assert pieces == ["cat", "", "", "猫", "", "\ufffd cat"] and tail == ""
    assert tok.decode([cat] + ids + [bad, cat]) == "cat\ufffd\ufffd\ufffd\ufffd cat"


@pytest.mark.parametrize("name", ["byte", "byte_level"])
def test_held_out_prompts_cut_at_token_boundaries(tokenizers, name):
    """The family's held-out prompts (demo, bench) call the tokenizer with the Hugging Face convention
    (``tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)``): both adapters honour it."""
    from cluster.family.corpus import heldout_prompts
    prompts = heldout_prompts(tokenizers[name], 2)
    assert len(prompts) == 2 and all(p["prompt_ids"] for p in prompts)
    for p in prompts:
        assert tokenizers[name].encode(p["prompt"]) == p["prompt_ids"]
