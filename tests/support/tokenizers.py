"""Tokenizers built on the fly for the detokenisation tests (seconds, no files needed beforehand), and texts
in several scripts to run them on."""
from __future__ import annotations

from cluster.config.paths import default_cache_dir, family_is_built
from cluster.family.tokenizer import train_tokenizer
from cluster.models.tokenizer import ByteTokenizer, HFTokenizer

TEXTS = ["Hello, world! def f(x):\n    return x * 2\n", "Привет, мир! Съешь же ещё этих булок.",
         "你好，世界。東京は日本の首都です。", "مرحبا بالعالم، كيف حالك؟", "emoji 😀👍🏽 🇫🇷 👨‍👩‍👧 done",
         "café naïve Ωmega ∑ ≠ ∞ — “quotes” \t tabs  double  spaces"]


def _byte_level(tmp_path):
    """The embedded family's tokenizer construction (byte-level BPE), trained here on the test texts."""
    tok = train_tokenizer(TEXTS * 3 + ["the cat sat on the mat " * 4], vocab_size=400)
    tok.save_pretrained(tmp_path / "byte_level")
    return HFTokenizer(tmp_path / "byte_level")


def _byte_fallback(tmp_path):
    """A Llama-style tokenizer: BPE with byte-fallback tokens <0x00>..<0xFF> for what the vocabulary lacks,
    Metaspace pre-tokenizer, and a decoder that strips the leading space; plus added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "c"), ("a", "t"), ("▁c", "at"), ("é", "t")]
    vocab = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list("▁abcdefghijklmnopqrstuvwxyzé")
    vocab += ["".join(m) for m in merges]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.add_tokens(["<tool>", " ||"])                      # added, not special: decoded as text
    fast.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})          # skipped when decoding
    fast.save_pretrained(tmp_path / "byte_fallback")
    return HFTokenizer(tmp_path / "byte_fallback")


def build_tokenizers(tmp_path) -> dict:
    """The byte tokenizer, both constructions above, and the embedded family's own if it is built."""
    out = {"byte": ByteTokenizer(), "byte_level": _byte_level(tmp_path), "byte_fallback": _byte_fallback(tmp_path)}
    if family_is_built(default_cache_dir()):
        out["family"] = HFTokenizer(default_cache_dir() / "tokenizer")
    return out
