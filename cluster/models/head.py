"""SpecDec++ acceptance-prediction head (Huang et al., *SpecDec++: Boosting Speculative Decoding via Adaptive
Candidate Lengths*): the head's architecture, saving and loading.  Its training is in
:mod:`cluster.family.heads`, the stopping rule in :mod:`cluster.core.draft.stop`.

The head reads the drafter's final hidden state e_i of a candidate token Y_i and predicts
P(Y_i accepted | Y_1..Y_{i-1} accepted) = min(1, p(Y_i) / q(Y_i)) (Huang et al. 2024, SpecDec++, eq. 4.1).
Drafting stops once the predicted probability that some candidate is rejected, 1 - prod_i sigmoid(f(e_i)),
exceeds a threshold h (section 4.3, Algorithm 1), or at a hard cap k_max.

Training (section 4.4): responses X sampled from the target; at every response position a drafter
candidate Y_i ~ q(. | prompt, X_<i) with label P_i = min(1, p(Y_i | .) / q(Y_i | .)); token mixing
(the drafter reads Z with Z_i = X_i for a fraction ``mix`` of positions and Y_i elsewhere; the loss is
taken on the Y positions only); weighted binary cross-entropy
-w_acc P log P^ - w_rej (1 - P) log(1 - P^).  The drafter is frozen, so its hidden states are computed
once per (Y, Z) draw and the head is trained on those features.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

HEAD_DIR = "specdec-head"


class AcceptanceHead(nn.Module):
    """D residual blocks x <- x + SiLU(W x + b), then a linear output (a (D+1)-layer ResNet,
    Huang et al. 2024, SpecDec++, sec. 5.1)."""

    def __init__(self, hidden: int, depth: int = 2):
        super().__init__()
        self.hidden, self.depth = hidden, depth
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth))
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # [..., H] -> logits [...]
        for lin in self.blocks:
            x = x + nn.functional.silu(lin(x))
        return self.out(x).squeeze(-1)

    @torch.inference_mode()
    def accept_prob(self, e: torch.Tensor) -> float:
        """sigmoid(f(e)) for one hidden state ``e [H]``."""
        return float(torch.sigmoid(self(e.float())))


# -- persistence --------------------------------------------------------------------------------
def save_head(head: AcceptanceHead, path: str | Path, meta: dict | None = None) -> Path:
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(path / "head.safetensors"))
    (path / "head.json").write_text(json.dumps({"hidden": head.hidden, "depth": head.depth, **(meta or {})},
                                               indent=2) + "\n")
    return path


def load_head(path: str | Path) -> AcceptanceHead:
    from safetensors.torch import load_file
    path = Path(path)
    if not (path / "head.json").is_file():
        raise FileNotFoundError(f"no SpecDec++ head in {path} (expected head.json, head.safetensors): "
                                "run `specserve train-head`")
    info = json.loads((path / "head.json").read_text())
    head = AcceptanceHead(int(info["hidden"]), int(info["depth"]))
    head.load_state_dict(load_file(str(path / "head.safetensors")))
    return head.eval()


_CACHE: dict[str, AcceptanceHead] = {}


def resolve_head(head) -> AcceptanceHead:
    """An :class:`AcceptanceHead` from a module or a directory (loaded once per process)."""
    if isinstance(head, nn.Module):
        return head
    key = str(Path(head).expanduser())
    if key not in _CACHE:
        _CACHE[key] = load_head(key)
    return _CACHE[key]


def last_hidden(out) -> torch.Tensor:
    """The final hidden states ``[B, T, H]`` of an HF forward with ``output_hidden_states=True``."""
    return out.hidden_states[-1]
