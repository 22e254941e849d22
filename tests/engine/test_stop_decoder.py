"""StopDecoder: incremental detokenisation with stop strings, in linear time (issue 21, item 6).

Whatever the steps' sizes, the emitted pieces concatenate to the final text, which is ``decode`` of all ids
(up to the first stop string, whose ids are kept up to the fewest that contain it); each token is decoded
once, and the characters searched for stop strings stay within the text plus a held-back suffix per step.
"""
import random

import pytest

from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.engine.stop import StopDecoder
from tests.support.tokenizers import TEXTS, build_tokenizers

LOCAL = ("byte", "byte_level", "family")         # decoders for which decode(ids) is the streamed text


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return build_tokenizers(tmp_path_factory.mktemp("tok"))


def _run(tok, ids, stop, rng):
    """Push ``ids`` in steps of 1..5 tokens as the engine does; returns (pieces, keep)."""
    dec, pieces, at = StopDecoder(tok, stop), [], 0
    while at < len(ids):
        n = rng.randint(1, 5)
        piece, keep = dec.push(ids[at:at + n])
        pieces.append(piece)
        at += n
        if keep is not None:
            return pieces, keep, dec
    pieces.append(dec.flush())
    return pieces, None, dec


@pytest.mark.parametrize("name", LOCAL)
def test_pieces_concatenate_to_decode_and_stop_where_decode_does(tokenizers, name):
    if name not in tokenizers:
        pytest.skip("the embedded family is not built (specserve zoo build)")
    tok, rng = tokenizers[name], random.Random(1)
    for text in TEXTS * 4:
        ids = tok.encode(text)
        full = tok.decode(ids)
        pieces, keep, dec = _run(tok, ids, (), rng)
        assert "".join(pieces) == dec.text == full and keep is None
        a = rng.randrange(len(full) - 1)
        stop = (full[a:a + rng.randint(1, 6)], "\u2603never")        # a stop string that occurs, one that does not
        pieces, keep, dec = _run(tok, ids, stop, rng)
        # the fewest ids whose text contains it, where a token ending inside a character (its text held
        # back by DecodeStream with the character) counts with the one that completes it
        assert stop[0] in tok.decode(ids[:keep])
        assert stop[0] not in tok.decode(ids[:keep - 1]) or tok.decode(ids[:keep - 1]).endswith("\ufffd")
        assert "".join(pieces) == dec.text == full[:full.find(stop[0])]
        assert all(stop[0] not in "".join(pieces[:i + 1]) for i in range(len(pieces)))


def test_random_ids_and_overlapping_stops(tokenizers):
    """Arbitrary byte ids (invalid UTF-8 included) with stops that overlap each other's prefixes."""
    tok, rng = tokenizers["byte"], random.Random(2)
    for _ in range(200):
        ids = [rng.choice(b"abab\xc3\xa9\xe4\xbd") for _ in range(rng.randint(1, 40))]
        full = tok.decode(ids)
        stop = ("abb", "bab", "\u00e9a")
        hits = [full.find(s) for s in stop if s in full]
        pieces, keep, dec = _run(tok, ids, stop, rng)
        assert "".join(pieces) == dec.text == (full[:min(hits)] if hits else full)
        if hits:
            assert keep == next(k for k in range(1, len(ids) + 1) if any(s in tok.decode(ids[:k]) for s in stop))


class _Counting:
    """A tokenizer whose whole-sequence ``decode`` must not be used while streaming; counts stream steps."""

    def __init__(self, inner):
        self.inner, self.steps = inner, 0

    def decode(self, ids):
        raise AssertionError("decode() of the whole sequence while streaming")

    def stream(self):
        inner, outer = self.inner.stream(), self

        class Counted:
            def step(self, token_id):
                outer.steps += 1
                return inner.step(token_id)

            def flush(self):
                return inner.flush()
        return Counted()


@pytest.mark.parametrize("name", ["byte", "byte_level"])
def test_work_is_linear_in_the_output(tokenizers, name):
    """Each token is decoded once, and stop-string search sees each character at most once plus a suffix
    of max(len(stop)) - 1 per step: with 3000+ tokens in one-token steps, the old decoder re-decoded the
    whole prefix at every step (~len^2 / 2 characters)."""
    tok = _Counting(tokenizers[name])
    ids = tok.inner.encode(" ".join(TEXTS) * 20)
    stop = ("\u2603never", "abcdefgh")
    dec = StopDecoder(tok, stop)
    for i in ids:
        dec.push([i])
    dec.flush()
    n_chars = len(dec.text)
    assert tok.steps == len(ids) > 1500 and dec.text == tok.inner.decode(ids)
    bound = len(stop) * (n_chars + len(ids) * (max(map(len, stop)) - 1))
    assert dec.searched <= bound < n_chars * n_chars / 20


def test_engine_stream_text_is_decode_of_the_ids(tiny_engine):
    """Sampled bytes from a random model (often invalid UTF-8): chunks concatenate to the result's text,
    which is decode of its ids, with and without a stop string."""
    tok = tiny_engine.tokenizer
    for seed in range(4):
        for stop in ((), ("e",)):
            chunks = list(tiny_engine.stream(GenerationRequest(
                prompt="Привет 😀 ", max_new_tokens=40, sampling=SamplingParams(1.0), seed=seed,
                strategy="speculative", stop=stop)))
            res = chunks[-1].result
            assert "".join(c.text for c in chunks) == res.text
            full = tok.decode(res.token_ids)
            assert res.text == (full[:full.find("e")] if res.finish_reason == "stop" else full)
