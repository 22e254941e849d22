"""Fast tests for the corpus split and the model-family builder (toy scale only)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import cluster.family.corpus as corpus
from cluster.config.paths import ZOO_VERSION, default_cache_dir
from cluster.family.build import build_zoo
from cluster.family.cache import load_manifest


def model_entry(manifest: dict, name: str) -> dict:
    """The manifest's entry of model ``name``."""
    return next(m for m in manifest["models"] if m["name"] == name)


# --------------------------------------------------------------------------- corpus


def test_stdlib_files_sorted_and_filtered():
    files = corpus.stdlib_files()
    root = corpus.stdlib_root()
    rels = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 100
    assert rels == sorted(rels)
    assert all(r.endswith(".py") for r in rels)
    for r in rels:
        dirs = r.split("/")[:-1]
        assert "site-packages" not in dirs
        assert not any("test" in d.lower() for d in dirs), r
    assert "os.py" in rels and "json/decoder.py" in rels


def test_split_is_deterministic_disjoint_and_nonempty():
    files = corpus.stdlib_files()
    train, held = corpus.split_files(files)
    assert train and held
    assert not set(train) & set(held)
    assert set(train) | set(held) == set(files)
    assert 0.01 < len(held) / len(files) < 0.10
    # same answer again, and independent of input order
    assert corpus.split_files(files) == (train, held)
    train_r, held_r = corpus.split_files(list(reversed(files)))
    assert set(train_r) == set(train) and set(held_r) == set(held)


def test_read_corpus_truncates():
    _, held = corpus.split_files(corpus.stdlib_files())
    text = corpus.read_corpus(held, max_chars=5000)
    assert len(text) == 5000
    assert text.startswith(corpus.read_file(held[0])[:100])


# --------------------------------------------------------------------------- tiny build


@pytest.fixture(scope="module")
def tiny_zoo(tmp_path_factory):
    cache = tmp_path_factory.mktemp("zoo") / "zoo-v1"
    t0 = time.perf_counter()
    manifest = build_zoo(cache, preset="tiny", progress=False)
    return cache, manifest, time.perf_counter() - t0


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_zoo):
    from transformers import AutoTokenizer

    cache, manifest, _ = tiny_zoo
    return AutoTokenizer.from_pretrained(model_entry(manifest, "target")["path"])


def test_heldout_prompts_deterministic(tiny_tokenizer):
    _, held = corpus.split_files(corpus.stdlib_files())
    texts = {corpus._rel_key(f): corpus.read_file(f) for f in held}
    a = corpus.heldout_prompts(tiny_tokenizer, 6, prompt_tokens=32, continuation_tokens=16, seed=1)
    b = corpus.heldout_prompts(tiny_tokenizer, 6, prompt_tokens=32, continuation_tokens=16, seed=1)
    c = corpus.heldout_prompts(tiny_tokenizer, 6, prompt_tokens=32, continuation_tokens=16, seed=2)
    assert a == b
    assert a != c
    assert len(a) == 6
    for item in a:
        assert set(item) >= {"prompt", "prompt_ids", "reference"}
        assert item["prompt"] and item["reference"]
        assert item["prompt_ids"] == tiny_tokenizer(item["prompt"], add_special_tokens=False)["input_ids"]
        assert 16 <= len(item["prompt_ids"]) <= 36
        src = texts[item["source"]]
        pos = src.find(item["prompt"] + item["reference"])
        assert pos >= 0  # the reference is the file's true continuation
        assert pos == 0 or src[pos - 1] == "\n"  # prompts start at a line boundary


def test_tiny_build_produces_loadable_checkpoints(tiny_zoo):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache, manifest, _ = tiny_zoo
    assert load_manifest(cache) is not None
    assert (cache / "manifest.json").is_file()
    on_disk = json.loads((cache / "manifest.json").read_text())
    assert on_disk["preset"] == "tiny" and on_disk["seed"] == 0
    names = [m["name"] for m in manifest["models"]]
    assert names == ["target", "drafter-large", "drafter-small"]
    assert set(manifest["agreement"]) == {"drafter-large", "drafter-small"}
    params = {m["name"]: m["params"] for m in manifest["models"]}
    assert params["target"] >= 10 * min(params.values())
    for m in manifest["models"]:
        d = Path(m["path"])
        assert d == (cache / m["name"]).resolve()
        assert (d / "model.safetensors").is_file()
        for key in ("params", "layers", "hidden", "heldout_loss", "latency_ms", "agreement"):
            assert key in m
        assert m["latency_ms"] > 0 and m["heldout_loss"] > 0
        assert set(m["cost_vs_target"]) == {"1", "16"} and all(c > 0 for c in m["cost_vs_target"].values())
        tok = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d)
        assert type(model).__name__ == "LlamaForCausalLM"
        assert model.config.tie_word_embeddings == (m["name"] == "drafter-small")  # the preset's choice
        assert model.config.eos_token_id == tok.eos_token_id == manifest["tokenizer"]["eos_token_id"]
        assert model.config.bos_token_id == tok.bos_token_id
        ids = tok("def foo(x):\n    return", return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=3, do_sample=False)
        assert out.shape[1] <= ids.shape[1] + 3 and out.shape[1] > ids.shape[1] - 1
        assert sum(p.numel() for p in model.parameters()) == m["params"]


def test_tiny_build_records_its_instruction_phase_and_generation_checks(tiny_zoo):
    from cluster.family.chateval import parses

    _, manifest, _ = tiny_zoo
    assert manifest["instruct"]["pairs"] > 10 and manifest["instruct"]["tokens"] > 0
    target = model_entry(manifest, "target")["training"]
    assert (target["instruct_steps"], target["instruct_rows"]) == (2, 1)
    chat = manifest["chat"]
    assert chat["requests"] == 2 and 0 <= chat["parsed"] <= 2 and 0 <= chat["stopped"] <= 2
    assert all(ex["parses"] == parses(ex["answer"]) for ex in chat["examples"])
    spec = manifest["speculative"]
    for kind in ("chat", "completion"):
        assert set(spec[kind]) == {"drafter-large", "drafter-small"}
        for row in spec[kind].values():
            assert 1 / (spec["k"] + 1) <= row["target_calls_per_token"] <= 1 and 0 <= row["acceptance"] <= 1


def test_second_call_uses_cache(tiny_zoo):
    cache, manifest, build_secs = tiny_zoo
    t0 = time.perf_counter()
    again = build_zoo(cache, preset="tiny", progress=False)
    assert time.perf_counter() - t0 < max(1.0, build_secs / 4)
    assert again["created_unix"] == manifest["created_unix"]
    assert again["fingerprint"] == manifest["fingerprint"]
    assert not list(cache.parent.glob(".*.tmp-*"))  # no leftover temp dirs


def test_incomplete_build_is_not_built(tmp_path):
    cache = tmp_path / "zoo-v1"
    assert load_manifest(cache) is None
    (cache / "target").mkdir(parents=True)  # e.g. a copy interrupted before the manifest
    assert load_manifest(cache) is None
    (cache / "manifest.json").write_text("{not json")
    assert load_manifest(cache) is None


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / f"zoo-v{ZOO_VERSION}"
    monkeypatch.delenv("SPECSERVE_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "specserve" / f"zoo-v{ZOO_VERSION}"


def test_full_preset_meets_size_ratio():
    """The real family's shapes satisfy the >= 10x parameter ratio (no training)."""
    from cluster.family.presets import PRESETS
    from cluster.family.common import _n_params
    from cluster.family.train import _make_model

    cfg = PRESETS["full"]
    sizes = [_n_params(_make_model(s, cfg, 0, 0)) for s in (cfg.target, *cfg.drafters)]
    assert sizes[0] >= cfg.min_param_ratio * min(sizes[1:])
    assert cfg.target.layers >= 3 * max(d.layers for d in cfg.drafters)


def test_zoo_info_prints_the_table_or_the_manifest(tiny_zoo, capsys):
    from cluster.cli.main import main

    cache, manifest, _ = tiny_zoo
    assert main(["zoo", "info", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "cost@1" in out and "cost@16" in out
    assert f"chat: {manifest['chat']['parsed']}/2 greedy answers" in out
    row = next(line for line in out.splitlines() if line.startswith("drafter-large"))
    entry = next(m for m in manifest["models"] if m["name"] == "drafter-large")
    assert row.split()[-2:] == [f"{entry['cost_vs_target'][b]:.3f}" for b in ("1", "16")]
    assert main(["zoo", "info", "--cache-dir", str(cache), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fingerprint"] == manifest["fingerprint"]


def test_preset_rejects_unknown_training_dtype():
    import dataclasses

    from cluster.family.presets import PRESETS

    with pytest.raises(ValueError, match="train_autocast.*'float16'"):
        dataclasses.replace(PRESETS["tiny"], train_autocast="float16")
