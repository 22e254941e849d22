"""Training the embedded family: the target's pre-training with cross-entropy and the joint distillation of
the drafters from it (KL to the target's soft labels mixed with CE), with warm-up + cosine LR schedules."""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from cluster.family.common import _bar, _ThreadTuner
from cluster.family.presets import ModelSpec, ZooConfig


def _make_model(spec: ModelSpec, cfg: ZooConfig, eot_id: int, seed: int):
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
        tie_word_embeddings=spec.tie_embeddings,
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


def _init_from_target(drafter, target) -> list[int]:
    """Copy embeddings, final norm and evenly spaced blocks of ``target`` into ``drafter``."""

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


def _batches(stream, batch: int, seq_len: int, steps: int, seed: int, chats=(), chat_from: int = 0):
    """``steps`` batches ``(x, w)``: ``batch`` random ``seq_len + 1`` windows of ``stream`` (seeded), and from step
    ``chat_from`` on, for each ``(chat, rows)`` of ``chats``, ``rows`` more rows cut from ``chat`` =
    ``(ids, weights, starts)`` (:func:`cluster.family.instruct.chat_stream`) at the start of a pair.  ``w``
    [rows, seq_len] weighs each predicted token's loss: 1 on ``stream`` rows, the chat weights (answers only) on
    chat rows."""

    gen = torch.Generator().manual_seed(seed)
    hi = len(stream) - seq_len - 1
    ar = torch.arange(seq_len + 1)
    used = []
    for (c_ids, c_w, c_starts), rows in chats:
        if rows > 0:
            c_starts = c_starts[c_starts + seq_len + 1 <= len(c_ids)]
            if len(c_starts) == 0:
                raise RuntimeError("the instruction pairs are too few for one training row")
            used.append((c_ids, c_w, c_starts, rows))
    for step in range(steps):
        starts = torch.randint(0, hi, (batch,), generator=gen)
        x = stream[starts[:, None] + ar].long()
        w = torch.ones(batch, seq_len)
        for c_ids, c_w, c_starts, rows in used if step >= chat_from else ():
            s = c_starts[torch.randint(0, len(c_starts), (rows,), generator=gen)][:, None] + ar
            x = torch.cat([x, c_ids[s].long()])
            w = torch.cat([w, c_w[s[:, 1:]]])
        yield x, w


def _lr_lambda(steps: int, warmup_frac: float, min_frac: float):
    warm = max(1, int(steps * warmup_frac))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        p = (step - warm) / max(1, steps - warm)
        return min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, p)))

    return f


def _autocast(cfg: ZooConfig):
    """Forward passes of training in bfloat16 on CPU when the preset asks for it (faster steps on CPU);
    parameters, gradients and optimizer state stay float32."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train_autocast == "bfloat16")


def _optimizer(model, lr: float, steps: int, cfg: ZooConfig, embedding_lr_scale: float = 1.0):
    """AdamW with decoupled weight decay on matrices only; untied embeddings and LM head get
    ``embedding_lr_scale`` times the learning rate and no weight decay (each of their rows sees few
    updates, so the blocks' learning rate leaves them behind)."""

    embed = set()
    if not model.config.tie_word_embeddings:
        embed = {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}
    params = list(model.named_parameters())
    decay = [p for n, p in params if p.ndim >= 2 and id(p) not in embed]
    no_decay = [p for n, p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if embed:
        groups.append({"params": [p for n, p in params if id(p) in embed], "weight_decay": 0.0,
                       "lr": lr * embedding_lr_scale})
    opt = torch.optim.AdamW(
        groups,
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(steps, cfg.warmup_frac, cfg.min_lr_frac))
    return opt, sched


def _chats(cfg: ZooConfig, chat, edits) -> list:
    return [(c, rows) for c, rows in ((chat, cfg.instruct_rows), (edits, cfg.edit_rows)) if c is not None]


def _train_target(model, stream, cfg: ZooConfig, seed: int, progress: bool, max_threads: int = 2, chat=None,
                  edits=None) -> dict:
    """Pre-train ``model`` with next-token cross-entropy on random windows of ``stream``; its last
    ``cfg.instruct_steps`` batches also hold ``cfg.instruct_rows`` rows of instruction pairs (``chat``, see
    :func:`_batches`) and ``cfg.edit_rows`` rows of edit pairs (``edits``, :mod:`cluster.family.edits`),
    whose loss is taken on the answers only."""

    tuner = _ThreadTuner(max_threads)
    model.train()
    model.config.use_cache = False
    opt, sched = _optimizer(model, cfg.target_lr, cfg.target_steps, cfg, cfg.embedding_lr_scale)
    t0 = time.perf_counter()
    ema = None
    batches = _batches(stream, cfg.target_batch, cfg.seq_len, cfg.target_steps, seed, _chats(cfg, chat, edits),
                       cfg.target_steps - cfg.instruct_steps)
    with _bar(progress, total=cfg.target_steps, desc="train target", unit="step") as bar:
        for x, w in batches:
            with tuner:
                with _autocast(cfg):
                    logits = model(input_ids=x[:, :-1], use_cache=False).logits
                ce = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1),
                                     reduction="none")
                loss = (ce * w.reshape(-1)).sum() / w.sum()
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
        "instruct_steps": cfg.instruct_steps if chat is not None else 0,
        "instruct_rows": cfg.instruct_rows if chat is not None else 0,
        "edit_rows": cfg.edit_rows if edits is not None else 0,
        "final_train_loss_ema": round(ema, 4) if ema is not None else None,
        "train_seconds": round(time.perf_counter() - t0, 2),
        "steps_by_threads": tuner.summary(),
    }


def _distill(
    target, drafters: dict, stream, cfg: ZooConfig, seed: int, progress: bool, max_threads: int = 2, chat=None,
    edits=None,
) -> dict:
    """Jointly distil every drafter from ``target`` (one target forward per batch).

    Loss per drafter: ``w * T^2 * KL(p_target || p_drafter)`` at temperature
    ``T`` plus ``(1 - w) * CE(true next token)``.  Every batch also holds ``cfg.instruct_rows`` rows of
    instruction pairs (``chat``) and ``cfg.edit_rows`` of edit pairs (``edits``), so the drafters follow the
    target on chat answers and edits too (loss on all tokens).
    """

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
        for x, _ in _batches(stream, cfg.distill_batch, cfg.seq_len, cfg.distill_steps, seed,
                             _chats(cfg, chat, edits)):
            with tuner:
                inp, y = x[:, :-1], x[:, 1:].reshape(-1)
                t0 = time.perf_counter()
                with torch.no_grad(), _autocast(cfg):
                    t_logits = target(input_ids=inp, use_cache=False).logits.float()
                    t_logp = F.log_softmax(t_logits.reshape(-1, t_logits.size(-1)) / tau, dim=-1)
                    t_p = t_logp.exp()
                t_target += time.perf_counter() - t0
                for name, d in drafters.items():
                    t0 = time.perf_counter()
                    opt, sched = opts[name]
                    with _autocast(cfg):
                        logits = d(input_ids=inp, use_cache=False).logits
                    logits = logits.float().reshape(-1, t_logp.size(-1))
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
            "instruct_rows": cfg.instruct_rows if chat is not None else 0,
            "edit_rows": cfg.edit_rows if edits is not None else 0,
            "final_kl_ema": round(ema.get(name, float("nan")), 4),
            "train_seconds": round(secs[name] + t_target / max(1, len(drafters)), 2),
            "steps_by_threads": tuner.summary(),
        }
    return out
