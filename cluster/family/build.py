"""The embedded model family ("zoo"): a target LM and its drafters, built locally.

The serving system needs a *family* of causal LMs that share a tokenizer: one
expensive ``target`` and cheaper drafters whose greedy predictions often agree
with it.  Nothing can be downloaded, so :func:`build_zoo` makes one from
scratch, on CPU, in a few minutes, from the Python standard library's source
(:mod:`cluster.family.corpus`):

1. train a byte-level BPE tokenizer (``tokenizers``) on the train split;
   ``<|endoftext|>`` is BOS, EOS, PAD and the document separator;
2. train ``target`` (a deep, narrow ``LlamaForCausalLM``) with cross-entropy.
   At this scale progress is limited by optimizer steps, and two choices buy
   the most per minute: forward passes under bfloat16 autocast (weights and
   optimizer state stay float32: faster steps on CPU), and untied input
   and output embeddings trained at 25x the blocks' learning rate (each
   embedding row sees few updates; tied embeddings reached a clearly worse
   held-out loss in the experiments behind the v2 preset).  Its last ``instruct_steps``
   batches also hold ``instruct_rows`` rows of instruction pairs
   (:mod:`cluster.family.instruct`: a train-split function's docstring or
   leading comment as a served chat request, the function as the answer, loss
   on the answer), so the target answers a chat request with code (v3), and
   ``edit_rows`` rows of edit pairs (:mod:`cluster.family.edits`);
3. distil ``drafter-large`` and ``drafter-small`` from the trained target
   (KL to the target's soft labels mixed with a little CE, one shared target
   forward per batch; every batch holds the same share of instruction rows).
   ``drafter-large`` shares the target's width and starts
   from a copy of the target's embeddings, first/last blocks, final norm and
   head ("layer-dropped" initialisation);
4. evaluate every model on the held-out files: loss (nats/token), next-token
   accuracy, and *greedy agreement* with the target (fraction of held-out
   positions where ``argmax drafter == argmax target``, teacher-forced); the
   target's greedy chat answers to held-out requests (how many parse) and each
   drafter's greedy speculation on them and on completions
   (:mod:`cluster.family.chateval`); and
   measure single-token forward latency with a KV cache (batch 1 at the build's
   thread counts; batch 1 and 16 at one thread, the served setting, as each
   model's *cost* relative to the target);
5. save each model as a Hugging Face checkpoint (safetensors + tokenizer) and
   write ``manifest.json``.

Cache layout (``cache_dir`` defaults to ``$SPECSERVE_CACHE/zoo-v<N>`` or
``~/.cache/specserve/zoo-v<N>``, N the zoo version)::

    cache_dir/
      manifest.json           # written last; its presence marks a complete build
      tokenizer/              # the shared tokenizer (save_pretrained)
      target/                 # config.json, generation_config.json,
      drafter-large/          # model.safetensors, tokenizer files
      drafter-small/

The build happens in a sibling temp directory that is renamed into place only
when complete, under a file lock, so an interrupted or concurrent build never
looks complete.  With ``force=False`` an existing, matching build is returned
as is.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import torch

import cluster.family.corpus as corpus
import cluster.family.edits as edits
import cluster.family.instruct as instruct
from cluster.config.paths import ZOO_VERSION, default_cache_dir
from cluster.family.cache import _build_lock, load_manifest
from cluster.family.chateval import evaluate_generation
from cluster.family.common import _bar, _n_params, _quiet_transformers, _torch_threads
from cluster.family.evaluate import _versions, evaluate, format_summary, measure_latency
from cluster.family.presets import EOT, ZooConfig, resolve_preset
from cluster.family.tokenizer import _encode_stream, train_tokenizer
from cluster.family.train import _distill, _init_from_target, _make_model, _train_target

__all__ = ["build_zoo"]


def build_zoo(
    cache_dir: Path | str | None = None,
    *,
    seed: int = 0,
    force: bool = False,
    progress: bool = True,
    preset: str | ZooConfig = "full",
    threads: int = 2,
) -> dict:
    """Build (or return the cached) model family in ``cache_dir``; returns the manifest.

    ``cache_dir`` defaults to :func:`default_cache_dir`.  If a complete build
    with the same configuration and seed is there and ``force`` is false, its
    manifest is returned without rebuilding.  ``preset`` is ``"full"`` (the
    real family, a few minutes on 2 CPU cores), ``"tiny"`` (seconds; for tests)
    or a :class:`ZooConfig`.  Prints a summary table when it builds.
    """
    cfg = resolve_preset(preset)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    fp = cfg.fingerprint(seed)
    with _build_lock(cache_dir):
        manifest = load_manifest(cache_dir)
        if manifest is not None and not force and manifest.get("fingerprint") == fp:
            return manifest
        for stale in cache_dir.parent.glob(f".{cache_dir.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by interrupted builds (we hold the lock)
        tmp = cache_dir.parent / f".{cache_dir.name}.tmp-{os.getpid()}"
        try:
            with _torch_threads(threads):
                _build_into(tmp, cfg, seed, fp, progress, threads)
            if cache_dir.exists():
                old = cache_dir.parent / f".{cache_dir.name}.tmp-old-{os.getpid()}"
                os.replace(cache_dir, old)
                os.replace(tmp, cache_dir)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, cache_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        manifest = load_manifest(cache_dir)
        if manifest is None:  # pragma: no cover - would be a bug in _build_into
            raise RuntimeError(f"zoo build in {cache_dir} produced no valid manifest")
    print(format_summary(manifest), flush=True)
    return manifest


def _build_into(out: Path, cfg: ZooConfig, seed: int, fingerprint: str, progress: bool, threads: int) -> None:

    t_start = time.perf_counter()
    out.mkdir(parents=True)
    torch.manual_seed(seed)

    # ---- corpus + tokenizer
    files = corpus.stdlib_files()
    train_files, held_files = corpus.split_files(files)
    train_texts = list(corpus.iter_texts(train_files))
    if cfg.max_train_chars is not None:
        kept, total = [], 0
        for t in train_texts:
            if total >= cfg.max_train_chars:
                break
            kept.append(t[: cfg.max_train_chars - total])
            total += len(kept[-1])
        train_texts = kept
    held_texts = list(corpus.iter_texts(held_files))
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(train_texts, cfg.vocab_size, progress)
    tok_secs = time.perf_counter() - t0
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    tokenizer.save_pretrained(out / "tokenizer")
    train_stream = _encode_stream(tokenizer, train_texts, progress, "encode train")
    held_stream = _encode_stream(tokenizer, held_texts, progress, "encode held-out")
    if len(train_stream) <= cfg.seq_len + 1 or len(held_stream) <= cfg.seq_len + 1:
        raise RuntimeError("corpus too small for the configured sequence length")

    pairs = instruct.train_pairs(train_files, max_chars=cfg.max_train_chars) if cfg.instruct_rows else []
    chat = instruct.chat_stream(tokenizer, pairs, eot_id) if pairs else None
    edit_pairs = edits.train_edits(train_files, seed=seed, max_chars=cfg.max_train_chars) if cfg.edit_rows else []
    edit_stream = instruct.chat_stream(tokenizer, edit_pairs, eot_id) if edit_pairs else None

    # ---- models
    target = _make_model(cfg.target, cfg, eot_id, seed)
    train_info = {"target": _train_target(target, train_stream, cfg, seed + 1, progress, threads, chat, edit_stream)}
    drafters = {}
    init_info = {}
    for k, spec in enumerate(cfg.drafters):
        d = _make_model(spec, cfg, eot_id, seed + 100 + k)
        if spec.init_from_target:
            if spec.hidden != cfg.target.hidden:
                raise ValueError(f"{spec.name}: init_from_target needs hidden == target hidden")
            init_info[spec.name] = {"copied_target_layers": _init_from_target(d, target)}
        drafters[spec.name] = d
    train_info.update(_distill(target, drafters, train_stream, cfg, seed + 2, progress, threads, chat,
                                edit_stream))
    models = {"target": target, **drafters}
    specs = {"target": cfg.target, **{s.name: s for s in cfg.drafters}}

    params = {n: _n_params(m) for n, m in models.items()}
    ratio = params["target"] / min(params[n] for n in drafters)
    if ratio < cfg.min_param_ratio:
        raise RuntimeError(f"target/smallest-drafter parameter ratio {ratio:.1f} < {cfg.min_param_ratio}")

    # ---- evaluation
    t0 = time.perf_counter()
    metrics = evaluate(models, held_stream, cfg, progress, max_threads=threads)
    eval_secs = time.perf_counter() - t0
    t0 = time.perf_counter()
    generation = evaluate_generation(models, tokenizer, files, cfg, eot_id, seed)
    gen_secs = time.perf_counter() - t0
    t0 = time.perf_counter()
    # batch 1 at each thread count, then the serving setting (one thread) at each cost batch
    settings = [(n, 1) for n in sorted({threads, 1}, reverse=True)] + [(1, b) for b in cfg.cost_batches if b != 1]
    measured = {}
    with _bar(progress, total=len(settings), desc="latency", unit="setting") as bar:
        for n, b in settings:
            torch.set_num_threads(n)
            measured[n, b] = measure_latency(
                models,
                rounds=cfg.latency_rounds,
                iters=cfg.latency_iters,
                warmup=cfg.latency_warmup,
                prompt_len=cfg.latency_prompt,
                batch=b,
            )
            bar.update(1)
    torch.set_num_threads(threads)
    latency = measured[threads, 1]
    latency_by_batch = {b: measured[1, b] for b in cfg.cost_batches}
    lat_secs = time.perf_counter() - t0

    # ---- save
    entries = []
    for name, m in models.items():
        d = out / name
        with _quiet_transformers():
            m.save_pretrained(d, safe_serialization=True)
        tokenizer.save_pretrained(d)
        spec = specs[name]
        entries.append(
            {
                "name": name,
                "role": "target" if name == "target" else "drafter",
                "dir": name,
                "architecture": "LlamaForCausalLM",
                "params": params[name],
                "layers": spec.layers,
                "hidden": spec.hidden,
                "intermediate": spec.intermediate,
                "heads": spec.heads,
                "kv_heads": spec.kv_heads,
                "heldout_loss": round(metrics[name]["loss"], 4),
                "top1_acc": round(metrics[name]["top1_acc"], 4),
                "agreement": round(metrics[name]["agreement"], 4),
                "latency_ms": round(latency[name], 3),
                "cost_vs_target": {
                    str(b): round(lat[name] / lat["target"], 3) for b, lat in latency_by_batch.items()
                },
                "training": {**train_info[name], **init_info.get(name, {})},
            }
        )
    manifest = {
        "zoo_version": ZOO_VERSION,
        "preset": cfg.preset,
        "fingerprint": fingerprint,
        "seed": seed,
        "created_unix": time.time(),
        "build_seconds": round(time.perf_counter() - t_start, 1),
        "phase_seconds": {
            "tokenizer": round(tok_secs, 1),
            **{f"train:{n}": i["train_seconds"] for n, i in train_info.items()},
            "evaluate": round(eval_secs, 1),
            "chat_evaluate": round(gen_secs, 1),
            "latency": round(lat_secs, 1),
        },
        "threads": threads,
        "versions": _versions(),
        "tokenizer": {
            "dir": "tokenizer",
            "type": "byte-level BPE",
            "vocab_size": len(tokenizer),
            "bos_token_id": eot_id,
            "eos_token_id": eot_id,
            "pad_token_id": eot_id,
            "special_tokens": [EOT],
            "adds_special_tokens": False,
        },
        "corpus": {
            "source": "python stdlib",
            "stdlib": str(corpus.stdlib_root()),
            "train_files": len(train_files),
            "heldout_files": len(held_files),
            "train_tokens": int(len(train_stream)),
            "heldout_tokens": int(len(held_stream)),
            "eval_tokens": metrics["target"]["eval_tokens"],
        },
        "instruct": {"source": "docstrings / leading comments of train-split functions -> the function",
                     "pairs": len(pairs), "tokens": int(len(chat[0])) if chat is not None else 0},
        "edit_pairs": {"pairs": len(edit_pairs), "tokens": int(len(edit_stream[0])) if edit_stream is not None else 0},
        **generation,
        "seq_len": cfg.seq_len,
        "param_ratio_target_to_smallest_drafter": round(ratio, 2),
        "agreement": {n: round(metrics[n]["agreement"], 4) for n in drafters},
        "agreement_definition": "fraction of teacher-forced held-out positions where argmax(drafter) == argmax(target)",
        "latency_definition": "median ms of one batch-1 single-token forward with KV cache, after warm-up",
        "latency_ms": {n: round(v, 3) for n, v in latency.items()},
        "latency_ms_by_threads": {
            str(n): {m: round(v, 3) for m, v in lat.items()} for (n, b), lat in measured.items() if b == 1
        },
        "latency_ms_by_batch": {str(b): {m: round(v, 3) for m, v in lat.items()} for b, lat in latency_by_batch.items()},
        "cost_definition": "a model's ms per single-token forward over the target's, one torch thread (as served), "
                           "at each batch size",
        "config": dataclasses.asdict(cfg),
        "models": entries,
    }
    # manifest last: its presence marks the build complete
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
