"""The embedded model family ("zoo"): a target LM and its drafters, built locally.

The serving system needs a *family* of causal LMs that share a tokenizer: one
expensive ``target`` and cheaper drafters whose greedy predictions often agree
with it.  Nothing can be downloaded, so :func:`build_zoo` makes one from
scratch, on CPU, in a few minutes, from the Python standard library's source
(:mod:`cluster.corpus`):

1. train a byte-level BPE tokenizer (``tokenizers``) on the train split;
   ``<|endoftext|>`` is BOS, EOS, PAD and the document separator;
2. train ``target`` (a deep, narrow ``LlamaForCausalLM``) with cross-entropy;
3. distil ``drafter-large`` and ``drafter-small`` from the trained target
   (KL to the target's soft labels mixed with a little CE, one shared target
   forward per batch).  ``drafter-large`` shares the target's width and starts
   from a copy of the target's embeddings, first/last blocks, final norm and
   head ("layer-dropped" initialisation);
4. evaluate every model on the held-out files: loss (nats/token), next-token
   accuracy, and *greedy agreement* with the target (fraction of held-out
   positions where ``argmax drafter == argmax target``, teacher-forced), and
   measure the batch-1 single-token forward latency with a KV cache;
5. save each model as a Hugging Face checkpoint (safetensors + tokenizer) and
   write ``manifest.json``.

Cache layout (``cache_dir`` defaults to ``$SPECSERVE_CACHE/zoo-v1`` or
``~/.cache/specserve/zoo-v1``)::

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

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from cluster import corpus

__all__ = [
    "ZOO_VERSION",
    "MODEL_NAMES",
    "ModelSpec",
    "ZooConfig",
    "PRESETS",
    "default_cache_dir",
    "load_manifest",
    "zoo_is_built",
    "build_zoo",
    "model_entry",
    "format_summary",
    "measure_latency",
]

ZOO_VERSION = 1
EOT = "<|endoftext|>"
MODEL_NAMES = ("target", "drafter-large", "drafter-small")


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ModelSpec:
    """Architecture (and, for the target, training schedule) of one model."""

    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    #: drafters only: start from a copy of the target's embeddings, norm, head
    #: and evenly spaced blocks (requires ``hidden`` == target hidden).
    init_from_target: bool = False


@dataclass(frozen=True)
class ZooConfig:
    """Everything that determines a build (hashed into the manifest)."""

    preset: str
    vocab_size: int
    seq_len: int
    target: ModelSpec
    drafters: tuple[ModelSpec, ...]
    # target pre-training
    target_steps: int
    target_batch: int
    target_lr: float
    # drafter distillation (all drafters trained jointly on the same batches)
    distill_steps: int
    distill_batch: int
    distill_lr: float
    distill_kl_weight: float = 0.9  # loss = w * KL(target || drafter) + (1 - w) * CE
    distill_temperature: float = 1.0
    warmup_frac: float = 0.05
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # data
    max_train_chars: int | None = None  # None: the whole train split
    eval_max_tokens: int = 65536
    eval_batch: int = 16
    # latency measurement
    latency_rounds: int = 5
    latency_iters: int = 30
    latency_warmup: int = 10
    latency_prompt: int = 32
    max_position_embeddings: int = 1024
    #: build fails if params(target) / params(smallest drafter) is below this
    min_param_ratio: float = 10.0

    def fingerprint(self, seed: int) -> str:
        blob = json.dumps({"config": dataclasses.asdict(self), "seed": seed, "v": ZOO_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


PRESETS: dict[str, ZooConfig] = {
    # ~7 min on 2 idle CPU cores.
    "full": ZooConfig(
        preset="full",
        vocab_size=4096,
        seq_len=256,
        target=ModelSpec("target", hidden=192, layers=6, intermediate=512, heads=6, kv_heads=6),
        drafters=(
            ModelSpec("drafter-large", hidden=192, layers=2, intermediate=512, heads=6, kv_heads=6, init_from_target=True),
            ModelSpec("drafter-small", hidden=64, layers=1, intermediate=192, heads=2, kv_heads=2),
        ),
        # at this scale progress is limited by the number of optimizer steps more
        # than by tokens per step, so batches are small (4 x 256 tokens).
        target_steps=800,
        target_batch=4,
        target_lr=2e-3,
        distill_steps=600,
        distill_batch=4,
        distill_lr=2e-3,
    ),
    # seconds; for tests and smoke runs only (models are essentially untrained).
    "tiny": ZooConfig(
        preset="tiny",
        vocab_size=300,
        seq_len=32,
        target=ModelSpec("target", hidden=64, layers=4, intermediate=128, heads=2, kv_heads=2),
        drafters=(
            ModelSpec("drafter-large", hidden=64, layers=1, intermediate=128, heads=2, kv_heads=2, init_from_target=True),
            ModelSpec("drafter-small", hidden=16, layers=1, intermediate=32, heads=1, kv_heads=1),
        ),
        target_steps=4,
        target_batch=4,
        target_lr=3e-3,
        distill_steps=3,
        distill_batch=4,
        distill_lr=3e-3,
        max_train_chars=100_000,
        eval_max_tokens=512,
        eval_batch=4,
        latency_rounds=1,
        latency_iters=3,
        latency_warmup=1,
        latency_prompt=4,
        max_position_embeddings=128,
    ),
}


# --------------------------------------------------------------------------- cache


def default_cache_dir() -> Path:
    """``$SPECSERVE_CACHE/zoo-v<N>`` if the variable is set, else ``~/.cache/specserve/zoo-v<N>``."""
    base = os.environ.get("SPECSERVE_CACHE")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "specserve"
    return root / f"zoo-v{ZOO_VERSION}"


def load_manifest(cache_dir: Path | str | None = None) -> dict | None:
    """The manifest of a complete build in ``cache_dir``, or ``None``.

    ``None`` when the manifest is missing, unreadable, of another zoo version, or
    when a model directory it lists is missing.  Each model entry's ``path`` is
    returned as an absolute path under ``cache_dir`` (the file stores it
    relative, so the cache can be moved).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache_dir / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("zoo_version") != ZOO_VERSION:
        return None
    for m in manifest.get("models", []):
        d = (cache_dir / m["dir"]).resolve()
        if not (d / "config.json").is_file():
            return None
        m["path"] = str(d)
    manifest["cache_dir"] = str(cache_dir.resolve())
    tok = manifest.get("tokenizer", {})
    if "dir" in tok:
        tok["path"] = str((cache_dir / tok["dir"]).resolve())
    return manifest


def zoo_is_built(cache_dir: Path | str | None = None) -> bool:
    """Whether ``cache_dir`` holds a complete build (see :func:`load_manifest`)."""
    return load_manifest(cache_dir) is not None


def model_entry(manifest: dict, name: str) -> dict:
    """The manifest entry of model ``name`` (``KeyError`` if absent)."""
    for m in manifest["models"]:
        if m["name"] == name:
            return m
    raise KeyError(name)


@contextlib.contextmanager
def _build_lock(cache_dir: Path):
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_dir.parent / f".{cache_dir.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _torch_threads(n: int):
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class _ThreadTuner:
    """Choose between 1 and ``max_threads`` torch threads by timing real steps.

    On an idle 2-core machine two intra-op threads are clearly faster than one,
    but when other processes compete for the cores every parallel op waits for
    whichever thread was descheduled, and two threads become several times
    *slower* than one.  Every ``period`` steps this times one step with each
    setting and keeps the faster.  The thread count does not change results.
    """

    def __init__(self, max_threads: int, period: int = 25):
        self.max = max(1, max_threads)
        self.period = period
        self.choice = self.max
        self.step = 0
        self.plan: list[int] = []
        self.trial: dict[int, float] = {}
        self.used: dict[int, int] = {}
        self._t0 = 0.0
        self._cur = self.max

    def __enter__(self):
        import torch

        if self.max > 1 and self.step >= 1 and (self.step - 1) % self.period == 0:
            self.plan, self.trial = [self.max, 1], {}  # skip step 0: it includes warm-up
        self._cur = self.plan[0] if self.plan else self.choice
        torch.set_num_threads(self._cur)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        dt = time.perf_counter() - self._t0
        if self.plan:
            self.trial[self.plan.pop(0)] = dt
            if not self.plan:
                self.choice = min(self.trial, key=self.trial.get)
        self.used[self._cur] = self.used.get(self._cur, 0) + 1
        self.step += 1
        return False

    def summary(self) -> dict:
        return {str(k): v for k, v in sorted(self.used.items())}


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' own progress bars (e.g. "Writing model shards")."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _bar(progress: bool, **kw):
    from tqdm.auto import tqdm

    return tqdm(disable=not progress, dynamic_ncols=True, **kw)


def train_tokenizer(texts: Sequence[str], vocab_size: int, progress: bool = False):
    """Train a byte-level BPE on ``texts``; returns a ``PreTrainedTokenizerFast``.

    ``<|endoftext|>`` (id 0) is BOS/EOS/PAD; no special tokens are added on
    encode.  Offsets are untrimmed so ``return_offsets_mapping`` is exact.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with _bar(progress, total=len(texts), desc="tokenizer", unit="file") as bar:

        def it():
            for t in texts:
                yield t
                bar.update(1)

        tok.train_from_iterator(it(), trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=None,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def _encode_stream(tokenizer, texts: Sequence[str], progress: bool = False, desc: str = "encode"):
    """Token ids of ``texts`` joined as ``EOT doc EOT doc ...`` (int32 tensor)."""
    import torch

    eot = tokenizer.convert_tokens_to_ids(EOT)
    backend = tokenizer.backend_tokenizer
    ids: list[int] = []
    chunk = 32
    with _bar(progress, total=len(texts), desc=desc, unit="file") as bar:
        for i in range(0, len(texts), chunk):
            for enc in backend.encode_batch(list(texts[i : i + chunk]), add_special_tokens=False):
                ids.append(eot)
                ids.extend(enc.ids)
            bar.update(len(texts[i : i + chunk]))
    ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


def _make_model(spec: ModelSpec, cfg: ZooConfig, eot_id: int, seed: int):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
        use_cache=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id, do_sample=False, max_new_tokens=64
    )
    return model


def _n_params(model) -> int:
    # tied embeddings are counted once
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _init_from_target(drafter, target) -> list[int]:
    """Copy embeddings, final norm and evenly spaced blocks of ``target`` into ``drafter``."""
    import torch

    n_t, n_d = len(target.model.layers), len(drafter.model.layers)
    picks = sorted({round(i * (n_t - 1) / max(1, n_d - 1)) for i in range(n_d)}) if n_d > 1 else [0]
    with torch.no_grad():
        drafter.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        drafter.model.norm.weight.copy_(target.model.norm.weight)
        if not drafter.config.tie_word_embeddings:
            drafter.lm_head.weight.copy_(target.lm_head.weight)
        for j, i in enumerate(picks):
            drafter.model.layers[j].load_state_dict(target.model.layers[i].state_dict())
    return picks


def _batches(stream, batch: int, seq_len: int, steps: int, seed: int):
    """``steps`` batches of random ``seq_len + 1`` windows from ``stream`` (seeded)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    hi = len(stream) - seq_len - 1
    ar = torch.arange(seq_len + 1)
    for _ in range(steps):
        starts = torch.randint(0, hi, (batch,), generator=gen)
        yield stream[starts[:, None] + ar].long()


def _lr_lambda(steps: int, warmup_frac: float, min_frac: float):
    warm = max(1, int(steps * warmup_frac))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        p = (step - warm) / max(1, steps - warm)
        return min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, p)))

    return f


def _optimizer(model, lr: float, steps: int, cfg: ZooConfig):
    import torch

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(steps, cfg.warmup_frac, cfg.min_lr_frac))
    return opt, sched


def _train_target(model, stream, cfg: ZooConfig, seed: int, progress: bool, max_threads: int = 2) -> dict:
    """Pre-train ``model`` with next-token cross-entropy on random windows of ``stream``."""
    import torch
    import torch.nn.functional as F

    tuner = _ThreadTuner(max_threads)
    model.train()
    model.config.use_cache = False
    opt, sched = _optimizer(model, cfg.target_lr, cfg.target_steps, cfg)
    t0 = time.perf_counter()
    ema = None
    with _bar(progress, total=cfg.target_steps, desc="train target", unit="step") as bar:
        for x in _batches(stream, cfg.target_batch, cfg.seq_len, cfg.target_steps, seed):
            with tuner:
                logits = model(input_ids=x[:, :-1], use_cache=False).logits
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
                sched.step()
            ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
            bar.set_postfix(loss=f"{ema:.3f}", threads=tuner.choice)
            bar.update(1)
    model.eval()
    model.config.use_cache = True
    return {
        "objective": "cross-entropy",
        "steps": cfg.target_steps,
        "batch": cfg.target_batch,
        "seq_len": cfg.seq_len,
        "lr": cfg.target_lr,
        "train_tokens": cfg.target_steps * cfg.target_batch * cfg.seq_len,
        "final_train_loss_ema": round(ema, 4) if ema is not None else None,
        "train_seconds": round(time.perf_counter() - t0, 2),
        "steps_by_threads": tuner.summary(),
    }


def _distill(
    target, drafters: dict, stream, cfg: ZooConfig, seed: int, progress: bool, max_threads: int = 2
) -> dict:
    """Jointly distil every drafter from ``target`` (one target forward per batch).

    Loss per drafter: ``w * T^2 * KL(p_target || p_drafter)`` at temperature
    ``T`` plus ``(1 - w) * CE(true next token)``.
    """
    import torch
    import torch.nn.functional as F

    tau, w = cfg.distill_temperature, cfg.distill_kl_weight
    tuner = _ThreadTuner(max_threads)
    target.eval()
    opts = {}
    for name, d in drafters.items():
        d.train()
        d.config.use_cache = False
        opts[name] = _optimizer(d, cfg.distill_lr, cfg.distill_steps, cfg)
    ema: dict[str, float] = {}
    secs = {name: 0.0 for name in drafters}
    t_target = 0.0
    with _bar(progress, total=cfg.distill_steps, desc="distil drafters", unit="step") as bar:
        for x in _batches(stream, cfg.distill_batch, cfg.seq_len, cfg.distill_steps, seed):
            with tuner:
                inp, y = x[:, :-1], x[:, 1:].reshape(-1)
                t0 = time.perf_counter()
                with torch.no_grad():
                    t_logits = target(input_ids=inp, use_cache=False).logits
                    t_logp = F.log_softmax(t_logits.reshape(-1, t_logits.size(-1)) / tau, dim=-1)
                    t_p = t_logp.exp()
                t_target += time.perf_counter() - t0
                for name, d in drafters.items():
                    t0 = time.perf_counter()
                    opt, sched = opts[name]
                    logits = d(input_ids=inp, use_cache=False).logits.reshape(-1, t_logp.size(-1))
                    d_logp = F.log_softmax(logits / tau, dim=-1)
                    kl = (t_p * (t_logp - d_logp)).sum(-1).mean() * tau * tau
                    loss = w * kl + (1 - w) * F.cross_entropy(logits, y) if w < 1 else kl
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(d.parameters(), cfg.grad_clip)
                    opt.step()
                    sched.step()
                    ema[name] = kl.item() if name not in ema else 0.9 * ema[name] + 0.1 * kl.item()
                    secs[name] += time.perf_counter() - t0
            bar.set_postfix({**{f"kl[{k}]": f"{v:.3f}" for k, v in ema.items()}, "threads": tuner.choice})
            bar.update(1)
    out = {}
    for name, d in drafters.items():
        d.eval()
        d.config.use_cache = True
        out[name] = {
            "objective": f"{w:g}*KL(target||drafter, T={tau:g}) + {1 - w:g}*CE",
            "steps": cfg.distill_steps,
            "batch": cfg.distill_batch,
            "seq_len": cfg.seq_len,
            "lr": cfg.distill_lr,
            "train_tokens": cfg.distill_steps * cfg.distill_batch * cfg.seq_len,
            "final_kl_ema": round(ema.get(name, float("nan")), 4),
            "train_seconds": round(secs[name] + t_target / max(1, len(drafters)), 2),
            "steps_by_threads": tuner.summary(),
        }
    return out


def evaluate(
    models: dict, stream, cfg: ZooConfig, progress: bool = False, reference: str = "target", max_threads: int = 2
) -> dict:
    """Held-out metrics for ``models`` (name -> model) on token ``stream``.

    Teacher-forced over non-overlapping ``seq_len`` windows (at most
    ``eval_max_tokens`` tokens): ``loss`` (mean nats/token), ``top1_acc``
    (argmax == true next token) and ``agreement`` (argmax == argmax of the
    ``reference`` model at the same position).
    """
    import torch
    import torch.nn.functional as F

    T = cfg.seq_len
    n_win = max(1, min((len(stream) - 1) // T, cfg.eval_max_tokens // T))
    wins = torch.stack([stream[i * T : i * T + T + 1] for i in range(n_win)]).long()
    stats = {n: {"nll": 0.0, "correct": 0, "agree": 0} for n in models}
    count = 0
    tuner = _ThreadTuner(max_threads, period=8)
    with torch.no_grad(), _bar(progress, total=n_win, desc="evaluate", unit="window") as bar:
        for i in range(0, n_win, cfg.eval_batch):
            x = wins[i : i + cfg.eval_batch]
            inp, y = x[:, :-1], x[:, 1:].reshape(-1)
            preds = {}
            with tuner:
                for name, m in models.items():
                    logits = m(input_ids=inp, use_cache=False).logits
                    logits = logits.reshape(-1, logits.size(-1)).float()
                    stats[name]["nll"] += F.cross_entropy(logits, y, reduction="sum").item()
                    preds[name] = logits.argmax(-1)
                    stats[name]["correct"] += (preds[name] == y).sum().item()
            for name in models:
                stats[name]["agree"] += (preds[name] == preds[reference]).sum().item()
            count += y.numel()
            bar.update(len(x))
    return {
        n: {
            "loss": s["nll"] / count,
            "top1_acc": s["correct"] / count,
            "agreement": s["agree"] / count,
            "eval_tokens": count,
        }
        for n, s in stats.items()
    }


def measure_latency(
    models: dict, *, rounds: int = 5, iters: int = 30, warmup: int = 10, prompt_len: int = 32, vocab: int | None = None
) -> dict:
    """Median wall time (ms) of one batch-1, single-token forward with a KV cache.

    For each model a ``prompt_len``-token prompt is prefilled, then single
    tokens are fed one at a time.  Models are measured in interleaved rounds
    (``warmup`` untimed + ``iters`` timed calls per model per round, fresh
    cache each round) so CPU contention affects all of them alike.
    """
    import torch

    samples: dict[str, list[float]] = {n: [] for n in models}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(rounds):
            for name, m in models.items():
                v = vocab or m.config.vocab_size
                ids = torch.randint(0, v, (1, prompt_len + warmup + iters), generator=gen)
                out = m(input_ids=ids[:, :prompt_len], use_cache=True)
                pkv = out.past_key_values
                for k in range(warmup + iters):
                    tok = ids[:, prompt_len + k : prompt_len + k + 1]
                    t0 = time.perf_counter()
                    out = m(input_ids=tok, past_key_values=pkv, use_cache=True)
                    dt = time.perf_counter() - t0
                    pkv = out.past_key_values
                    if k >= warmup:
                        samples[name].append(dt * 1e3)
    return {n: statistics.median(s) for n, s in samples.items()}


def _versions() -> dict:
    import tokenizers
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "platform": platform.platform(),
    }


def format_summary(manifest: dict) -> str:
    """A short human-readable table of a manifest."""
    lines = [
        f"specserve zoo v{manifest['zoo_version']} ({manifest['preset']}, seed {manifest['seed']}) "
        f"at {manifest.get('cache_dir', '?')} - built in {manifest['build_seconds']:.0f} s",
        f"{'model':<14}{'params':>9}{'layers':>7}{'hidden':>7}{'heldout_loss':>13}{'top1_acc':>9}"
        f"{'agree':>7}{'ms/call':>9}{'x_target':>9}",
    ]
    t_ms = model_entry(manifest, "target")["latency_ms"]
    for m in manifest["models"]:
        agree = "-" if m["name"] == "target" else f"{m['agreement']:.3f}"
        lines.append(
            f"{m['name']:<14}{m['params'] / 1e6:>8.2f}M{m['layers']:>7}{m['hidden']:>7}"
            f"{m['heldout_loss']:>13.3f}{m['top1_acc']:>9.3f}{agree:>7}{m['latency_ms']:>9.2f}"
            f"{t_ms / m['latency_ms']:>9.2f}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- build


def _resolve_config(preset: str | ZooConfig) -> ZooConfig:
    if isinstance(preset, ZooConfig):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown zoo preset {preset!r}; choose from {sorted(PRESETS)}") from None


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
    cfg = _resolve_config(preset)
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
    import torch

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

    # ---- models
    target = _make_model(cfg.target, cfg, eot_id, seed)
    train_info = {"target": _train_target(target, train_stream, cfg, seed + 1, progress, threads)}
    drafters = {}
    init_info = {}
    for k, spec in enumerate(cfg.drafters):
        d = _make_model(spec, cfg, eot_id, seed + 100 + k)
        if spec.init_from_target:
            if spec.hidden != cfg.target.hidden:
                raise ValueError(f"{spec.name}: init_from_target needs hidden == target hidden")
            init_info[spec.name] = {"copied_target_layers": _init_from_target(d, target)}
        drafters[spec.name] = d
    train_info.update(_distill(target, drafters, train_stream, cfg, seed + 2, progress, threads))
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
    thread_counts = sorted({threads, 1}, reverse=True)
    latency_by_threads = {}
    with _bar(progress, total=len(thread_counts), desc="latency", unit="setting") as bar:
        for n in thread_counts:
            torch.set_num_threads(n)
            latency_by_threads[n] = measure_latency(
                models,
                rounds=cfg.latency_rounds,
                iters=cfg.latency_iters,
                warmup=cfg.latency_warmup,
                prompt_len=cfg.latency_prompt,
            )
            bar.update(1)
    torch.set_num_threads(threads)
    latency = latency_by_threads[threads]
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
        "seq_len": cfg.seq_len,
        "param_ratio_target_to_smallest_drafter": round(ratio, 2),
        "agreement": {n: round(metrics[n]["agreement"], 4) for n in drafters},
        "agreement_definition": "fraction of teacher-forced held-out positions where argmax(drafter) == argmax(target)",
        "latency_definition": "median ms of one batch-1 single-token forward with KV cache, after warm-up",
        "latency_ms": {n: round(v, 3) for n, v in latency.items()},
        "latency_ms_by_threads": {
            str(k): {n: round(v, 3) for n, v in lat.items()} for k, lat in latency_by_threads.items()
        },
        "config": dataclasses.asdict(cfg),
        "models": entries,
    }
    # manifest last: its presence marks the build complete
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
