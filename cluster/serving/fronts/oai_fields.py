"""OpenAI / vLLM request fields beyond sampling, and the per-request statistics in vLLM's and OpenAI's shapes.

* ``prediction`` (OpenAI's predicted outputs, both endpoints): ``{"type": "content", "content": a string or a
  list of text parts}``; the text becomes the request's Max-Gram prediction index (:mod:`cluster.core.prediction`).
  The answer's ``usage.completion_tokens_details`` reports ``accepted_prediction_tokens`` (draft tokens taken
  from the prediction that verification kept) and ``rejected_prediction_tokens`` (those it refused), the
  meaning OpenAI gives them: prediction tokens that did / did not appear in the completion.
* ``chat_template_kwargs`` (vLLM's, chat only): extra variables for the checkpoint's chat template, e.g. Qwen3's
  ``{"enable_thinking": false}``; a name the template never reads has no effect (as on vLLM: agent frameworks send
  such switches to every server); :mod:`cluster.models.chat_template` refuses a name the server sets itself and a
  value the template cannot read (text for a switch it only tests).
* ``metrics.speculative_decoding``: the request's speculative statistics under vLLM's definitions
  (``vllm/v1/spec_decode/metrics.py``: a draft is one verification step over drafted tokens; the mean
  acceptance length counts the token the target adds to each draft; the draft acceptance rate is accepted over
  drafted tokens), beside specserve's own ``stats``.
"""
from __future__ import annotations

import json
from typing import Any

from cluster.errors import ParamError
from cluster.models.chat_template import RESERVED_TEMPLATE_KWARGS

PREDICTION_ALLOWED = ('{"type": "content", "content": a string or a list of text parts '
                      '[{"type": "text", "text": a string}]}')
MAX_TEMPLATE_KWARGS, MAX_TEMPLATE_KWARGS_BYTES = 16, 4096
TEMPLATE_KWARGS_ALLOWED = (f"null or an object of at most {MAX_TEMPLATE_KWARGS} template variables (identifiers, not "
                           f"{', '.join(RESERVED_TEMPLATE_KWARGS[:4])}, ...; those the model's chat template does not "
                           f"read have no effect; JSON values, {MAX_TEMPLATE_KWARGS_BYTES} bytes in all)")


def prediction_text(value: Any) -> str | None:
    """The predicted text of an OpenAI ``prediction`` object (None: none); a bad shape is a ParamError naming
    ``prediction`` (the text's length and content are the engine's to check)."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"type", "content"} or value["type"] != "content":
        raise ParamError("prediction", PREDICTION_ALLOWED, value)
    content = value["content"]
    if isinstance(content, list):
        if not content or not all(isinstance(p, dict) and set(p) == {"type", "text"} and p["type"] == "text"
                                  and isinstance(p["text"], str) for p in content):
            raise ParamError("prediction", PREDICTION_ALLOWED, value)
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ParamError("prediction", PREDICTION_ALLOWED, value)
    return content


def template_kwargs(value: Any) -> dict | None:
    """``chat_template_kwargs`` checked for shape and size (None: none)."""
    if value is None or value == {}:
        return None
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS:
        raise ParamError("chat_template_kwargs", TEMPLATE_KWARGS_ALLOWED, value)
    for key in value:
        if not (isinstance(key, str) and key.isidentifier() and len(key) <= 64):
            raise ParamError("chat_template_kwargs", TEMPLATE_KWARGS_ALLOWED, key)
    try:
        size = len(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        raise ParamError("chat_template_kwargs", TEMPLATE_KWARGS_ALLOWED, value) from None
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise ParamError("chat_template_kwargs", TEMPLATE_KWARGS_ALLOWED, f"{size} bytes")
    return dict(value)


def prediction_usage(stats) -> dict:
    """OpenAI's ``completion_tokens_details`` of a request that sent a prediction."""
    return {"accepted_prediction_tokens": stats.prediction_accepted,
            "rejected_prediction_tokens": stats.prediction_drafted - stats.prediction_accepted}


def speculative_decoding(stats) -> dict:
    """vLLM's per-request speculative statistics of one request (see the module docstring)."""
    drafts = stats.steps
    return {"num_drafts": drafts, "num_draft_tokens": stats.drafted_tokens,
            "num_accepted_tokens": stats.accepted_tokens,
            "mean_acceptance_length": 1.0 + stats.accepted_tokens / drafts if drafts else None,
            "draft_acceptance_rate": stats.accepted_tokens / stats.drafted_tokens if stats.drafted_tokens else None,
            "acceptance_histogram": list(stats.accepted_hist),
            "num_accepted_tokens_per_pos": list(stats.accepted_per_pos),
            "acceptance_rate_per_pos": [n / drafts for n in stats.accepted_per_pos] if drafts else []}
