"""Evaluation of the built family: held-out loss, top-1 accuracy and greedy agreement with the target,
batch-1 single-token forward latency with a KV cache, and a printable summary of a manifest."""
from __future__ import annotations

import platform
import statistics
import time

import torch
import torch.nn.functional as F

from cluster.family.common import _bar, _ThreadTuner
from cluster.family.presets import ZooConfig


def evaluate(
    models: dict, stream, cfg: ZooConfig, progress: bool = False, reference: str = "target", max_threads: int = 2
) -> dict:
    """Held-out metrics for ``models`` (name -> model) on token ``stream``.

    Teacher-forced over non-overlapping ``seq_len`` windows (at most
    ``eval_max_tokens`` tokens): ``loss`` (mean nats/token), ``top1_acc``
    (argmax == true next token) and ``agreement`` (argmax == argmax of the
    ``reference`` model at the same position).
    """

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
    models: dict, *, rounds: int = 5, iters: int = 30, warmup: int = 10, prompt_len: int = 32, vocab: int | None = None,
    batch: int = 1,
) -> dict:
    """Median wall time (ms) of one single-token forward of ``batch`` rows with a KV cache.

    For each model ``batch`` prompts of ``prompt_len`` tokens are prefilled,
    then one token per row is fed at a time.  Models are measured in interleaved rounds
    (``warmup`` untimed + ``iters`` timed calls per model per round, fresh
    cache each round) so CPU contention affects all of them alike.
    """

    samples: dict[str, list[float]] = {n: [] for n in models}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(rounds):
            for name, m in models.items():
                v = vocab or m.config.vocab_size
                ids = torch.randint(0, v, (batch, prompt_len + warmup + iters), generator=gen)
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
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "platform": platform.platform(),
    }


def format_summary(manifest: dict) -> str:
    """A short human-readable table of a manifest: size, held-out loss, agreement, ms per call and the cost
    of a call relative to the target's at each measured batch size (``-`` where an older build lacks it)."""
    batches = list(manifest.get("latency_ms_by_batch", {}))
    lines = [
        f"specserve zoo v{manifest['zoo_version']} ({manifest['preset']}, seed {manifest['seed']}) "
        f"at {manifest.get('cache_dir', '?')} - built in {manifest['build_seconds']:.0f} s",
        f"{'model':<14}{'params':>9}{'layers':>7}{'hidden':>7}{'heldout_loss':>13}{'top1_acc':>9}"
        f"{'agree':>7}{'ms/call':>9}" + "".join(f"{'cost@' + b:>9}" for b in batches),
    ]
    for m in manifest["models"]:
        agree = "-" if m["name"] == "target" else f"{m['agreement']:.3f}"
        costs = m.get("cost_vs_target", {})
        lines.append(
            f"{m['name']:<14}{m['params'] / 1e6:>8.2f}M{m['layers']:>7}{m['hidden']:>7}"
            f"{m['heldout_loss']:>13.3f}{m['top1_acc']:>9.3f}{agree:>7}{m['latency_ms']:>9.2f}"
            + "".join(f"{costs[b]:>9.3f}" if b in costs else f"{'-':>9}" for b in batches)
        )
    lines.append("cost@B: ms per call over the target's at batch B, one torch thread (as served)")
    chat, spec = manifest.get("chat"), manifest.get("speculative")
    if chat:
        lines.append(f"chat: {chat['parsed']}/{chat['requests']} greedy answers to held-out requests parse "
                     f"(ast.parse), {chat['stopped']} stopped before {chat['max_new_tokens']} tokens")
    edit = manifest.get("edit")
    if edit:
        lines.append(f"edit: {edit['exact']}/{edit['requests']} greedy answers to held-out edit requests are the "
                     f"changed function exactly; token ratio {edit['token_ratio']:.3f}")
    if spec:
        lines.append(f"greedy speculation, k = {spec['k']}: target calls per token (acceptance)")
        for name in spec["chat"]:
            lines.append(f"  {name:<14}" + "".join(
                f"{kind} {spec[kind][name]['target_calls_per_token']:.3f} ({spec[kind][name]['acceptance']:.3f})  "
                for kind in ("completion", "chat")).rstrip())
    return "\n".join(lines)
