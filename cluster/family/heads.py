"""Training of SpecDec++ acceptance-prediction heads (Huang et al., *SpecDec++: Boosting Speculative Decoding
via Adaptive Candidate Lengths*, section 4.4): training prompts, target-sampled responses, token-mixed
features with min(1, p/q) labels, the weighted BCE fit, and the heads of the embedded family."""
from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

import cluster.family.build as zoo
from cluster.family.bigram import corpus_texts
from cluster.models.head import HEAD_DIR, AcceptanceHead, last_hidden, save_head
from cluster.models.tokenizer import HFTokenizer


# -- training data ------------------------------------------------------------------------------
def train_prompt_ids(tokenizer, n: int, prompt_tokens: int = 48, seed: int = 0,
                     max_chars: int = 2_000_000) -> list[list[int]]:
    """``n`` prompts of exactly ``prompt_tokens`` tokens cut from the zoo's *training* split."""
    rng = random.Random(seed)
    texts = [t for t in corpus_texts(max_chars) if len(t) > 40 * prompt_tokens]
    out = []
    while len(out) < n:
        t = texts[rng.randrange(len(texts))]
        c0 = rng.randrange(0, len(t) - 20 * prompt_tokens)
        ids = tokenizer.encode(t[c0:c0 + 20 * prompt_tokens])
        if len(ids) >= prompt_tokens:
            out.append(ids[:prompt_tokens])
    return out


@torch.inference_mode()
def sample_responses(target, prompts: list[list[int]], n_tokens: int, temperature: float = 1.0,
                     seed: int = 0, batch: int = 16) -> torch.Tensor:
    """Responses sampled from the target: ``[B, P + n_tokens]`` (prompt + response), batched."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for s in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[s:s + batch])
        from transformers import DynamicCache
        cache = DynamicCache(config=target.config)
        out = target(input_ids=ids, past_key_values=cache, use_cache=True)
        seq = ids
        for _ in range(n_tokens):
            probs = torch.softmax(out.logits[:, -1].float() / temperature, -1)
            nxt = torch.multinomial(probs, 1, generator=g)
            seq = torch.cat([seq, nxt], 1)
            out = target(input_ids=nxt, past_key_values=cache, use_cache=True)
        rows.append(seq)
    return torch.cat(rows)


@torch.no_grad()
def make_features(target, drafter, seqs: torch.Tensor, prompt_len: int, *, draws: int = 4, mix: float = 0.3,
                  temperature: float = 1.0, seed: int = 0, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [M, H], labels [M]) per Huang et al. 2024, SpecDec++, sec. 4.4: candidates Y_i ~ q_i, labels
    min(1, p_i(Y_i)/q_i(Y_i)), token-mixed drafter inputs, Y positions only."""
    g = torch.Generator().manual_seed(seed)
    feats, labels = [], []
    for s in range(0, seqs.shape[0], batch):
        x = seqs[s:s + batch]                                                   # [B, T]
        p = torch.softmax(target(input_ids=x).logits[:, prompt_len - 1:-1].float() / temperature, -1)
        q = torch.softmax(drafter(input_ids=x).logits[:, prompt_len - 1:-1].float() / temperature, -1)
        B, N, V = q.shape                                                       # response positions
        for _ in range(draws):
            y = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, N)   # [B, N]
            lab = torch.clamp(p.gather(-1, y[..., None]) / q.gather(-1, y[..., None]), max=1.0)[..., 0]
            from_y = torch.rand(B, N, generator=g) >= mix                       # loss positions
            z = torch.where(from_y, y, x[:, prompt_len:])
            h = last_hidden(drafter(input_ids=torch.cat([x[:, :prompt_len], z], 1),
                                    output_hidden_states=True))[:, prompt_len:].float()   # [B, N, H]
            feats.append(h[from_y])
            labels.append(lab[from_y])
    return torch.cat(feats), torch.cat(labels)


def weighted_bce(logits: torch.Tensor, target: torch.Tensor, w_acc: float = 1.0, w_rej: float = 1.0) -> torch.Tensor:
    """-w_acc P log P^ - w_rej (1 - P) log(1 - P^), averaged (Huang et al. 2024, SpecDec++, section 4.4)."""
    return -(w_acc * target * nn.functional.logsigmoid(logits)
             + w_rej * (1 - target) * nn.functional.logsigmoid(-logits)).mean()


def fit_head(feats: torch.Tensor, labels: torch.Tensor, *, depth: int = 2, w_acc: float = 1.0, w_rej: float = 1.0,
             epochs: int = 6, batch: int = 256, lr: float = 2e-3, seed: int = 0, progress: bool = True
             ) -> tuple[AcceptanceHead, dict]:
    """Adam with a cosine schedule (Huang et al. 2024, SpecDec++, appendix D) on the weighted BCE; returns the
    head and its loss before and after training."""
    torch.manual_seed(seed)
    head = AcceptanceHead(feats.shape[-1], depth)
    steps = max(1, epochs * math.ceil(len(feats) / batch))
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    with torch.no_grad():
        before = float(weighted_bce(head(feats), labels, w_acc, w_rej))
    g = torch.Generator().manual_seed(seed)
    bar = tqdm(total=steps, desc="train head", unit="step", disable=not progress)
    for _ in range(epochs):
        perm = torch.randperm(len(feats), generator=g)
        for s in range(0, len(feats), batch):
            idx = perm[s:s + batch]
            loss = weighted_bce(head(feats[idx]), labels[idx], w_acc, w_rej)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.4f}")
    bar.close()
    head.eval()
    with torch.no_grad():
        after = float(weighted_bce(head(feats), labels, w_acc, w_rej))
        mean_pred = float(torch.sigmoid(head(feats)).mean())
    return head, dict(loss_before=before, loss_after=after, examples=len(feats),
                      mean_label=float(labels.mean()), mean_pred=mean_pred)


def train_head(target, drafter, tokenizer, *, prompts: int = 64, prompt_tokens: int = 48,
               response_tokens: int = 48, depth: int = 2, w_acc: float = 1.0, w_rej: float = 1.0,
               mix: float = 0.3, draws: int = 4, epochs: int = 6, seed: int = 0, progress: bool = True,
               seqs: torch.Tensor | None = None) -> tuple[AcceptanceHead, dict]:
    """The whole recipe on HF causal LMs ``target`` and ``drafter`` (``seqs``: reuse sampled responses)."""
    t0 = time.perf_counter()
    if seqs is None:
        ids = train_prompt_ids(tokenizer, prompts, prompt_tokens, seed)
        seqs = sample_responses(target, ids, response_tokens, seed=seed)
    feats, labels = make_features(target, drafter, seqs, prompt_tokens, draws=draws, mix=mix, seed=seed + 1)
    head, info = fit_head(feats, labels, depth=depth, w_acc=w_acc, w_rej=w_rej, epochs=epochs, seed=seed,
                          progress=progress)
    info.update(seconds=round(time.perf_counter() - t0, 1), depth=depth, w_acc=w_acc, w_rej=w_rej, mix=mix,
                prompts=int(seqs.shape[0]), response_tokens=int(seqs.shape[1] - prompt_tokens))
    return head, info


def build_head(cache_dir: str | Path | None = None, drafters: Sequence[str] = ("drafter-large", "drafter-small"),
               *, prompts: int = 64, seed: int = 0, progress: bool = True, force: bool = False) -> dict:
    """Train the SpecDec++ heads of the embedded family into ``cache_dir/specdec-head/<drafter>/``.

    Called at the end of the zoo build (a minute or two on 2 CPU cores); returns {drafter: training info}.
    """
    from transformers import AutoModelForCausalLM

    cache = Path(cache_dir) if cache_dir is not None else zoo.default_cache_dir()
    todo = [d for d in drafters if force or not (cache / HEAD_DIR / d / "head.json").is_file()]
    if not todo:
        return {}
    target = AutoModelForCausalLM.from_pretrained(str(cache / "target"), local_files_only=True).eval()
    tok = HFTokenizer(cache / "target")
    ids = train_prompt_ids(tok, prompts, 48, seed)
    seqs = sample_responses(target, ids, 48, seed=seed)
    out = {}
    for name in todo:
        drafter = AutoModelForCausalLM.from_pretrained(str(cache / name), local_files_only=True).eval()
        head, info = train_head(target, drafter, tok, seqs=seqs, seed=seed, progress=progress)
        save_head(head, cache / HEAD_DIR / name, {"drafter": name, **info})
        out[name] = info
    return out
