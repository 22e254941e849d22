"""Chat messages -> prompt text, with the checkpoint's own chat template (Hugging Face chat templates:
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``).

The rendered text is tokenized like any prompt (without added special tokens: the template writes its own
BOS and turn markers, as vLLM does for chat).  Messages are checked first, each refusal a :class:`ParamError`
naming ``messages``: a non-empty list of at most MAX_MESSAGES objects ``{"role", "content"}``, a role in
ROLES, a content that is a string or a list of OpenAI text parts ``[{"type": "text", "text": ...}]`` (joined;
what vLLM's ``openai-chat`` benchmark client sends), at most MAX_PROMPT_CHARS characters in all.  A tokenizer
without a chat template is refused (naming ``messages``), never given a made-up format.
"""
from __future__ import annotations

from typing import Any

import jinja2
import jinja2.ext
from jinja2 import meta

from cluster.errors import ParamError, check_text
from cluster.models.tokenizer import ByteTokenizer

MAX_MESSAGES = 256
MAX_CHAT_CHARS = 1 << 20          # every message's content together (cluster.engine.request.MAX_PROMPT_CHARS)
ROLES = ("system", "developer", "user", "assistant")
ALLOWED = (f"a non-empty list of at most {MAX_MESSAGES} objects {{\"role\": one of {', '.join(ROLES)}, "
           "\"content\": a string or a list of text parts}")

# The template of the embedded family and of the byte-level tokenizer of the tiny test models: both are
# trained on (or stand in for) Python source, so a conversation is written as Python comments, one line per
# message line, and the generation prompt opens the assistant's turn.
CODE_CHAT_TEMPLATE = (
    "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] | replace('\\n', '\\n# ') }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}")


def chat_template(tokenizer) -> str | None:
    """The tokenizer's chat template (a transformers tokenizer's, behind the adapter's ``.tok``), or None."""
    if isinstance(tokenizer, ByteTokenizer):
        return CODE_CHAT_TEMPLATE
    template = getattr(getattr(tokenizer, "tok", tokenizer), "chat_template", None)
    return template if isinstance(template, str) and template else None


def check_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` as plain ``{"role", "content"}`` dicts with string contents (raises ParamError)."""
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise ParamError("messages", ALLOWED, messages)
    out, chars = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or "content" not in m:
            raise ParamError("messages", ALLOWED + f" (message {i})", m)
        content = _text(m["content"], i)
        chars += len(content)
        if chars > MAX_CHAT_CHARS:
            raise ParamError("messages", f"at most {MAX_CHAT_CHARS} characters of content", f"{chars}+ characters")
        out.append({"role": m["role"], "content": content})
    return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, list):              # OpenAI content parts: only text ones
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ParamError("messages", f"text parts {{\"type\": \"text\", \"text\": a string}} (message {i})",
                             content)
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ParamError("messages", f"a string content (message {i})", content)
    return check_text("messages", content, MAX_CHAT_CHARS, allow_empty=True)


# what the server passes to a template itself, and transformers' template globals: never a client's kwargs
RESERVED_TEMPLATE_KWARGS = ("messages", "conversation", "add_generation_prompt", "tokenize", "chat_template",
                            "tools", "documents", "continue_final_message", "return_dict", "return_tensors",
                            "padding", "truncation", "max_length", "tokenizer_kwargs", "bos_token", "eos_token",
                            "pad_token", "unk_token", "raise_exception", "strftime_now", "tojson")


def template_variables(template: str) -> set[str] | None:
    """The variables a chat template reads (Jinja's ``meta.find_undeclared_variables`` of its syntax tree, with
    the extensions transformers compiles templates with); None when it does not parse here (then the
    template itself decides when it is rendered)."""
    try:
        ast = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(template)
    except jinja2.TemplateSyntaxError:
        return None
    return meta.find_undeclared_variables(ast)


def check_template_kwargs(template: str, kwargs: dict | None) -> dict:
    """``kwargs`` (``chat_template_kwargs``): names the template reads, none the server sets itself.  Jinja
    renders a variable the template never mentions as if it were not there, so a misspelt or unsupported switch
    (``enable_thinkng``, or ``enable_thinking`` for a model that does not think) would be ignored silently: it
    is refused, naming it, as every field this server does not act on is."""
    names = set(kwargs or {})
    read = template_variables(template)
    readable = None if read is None else read - set(RESERVED_TEMPLATE_KWARGS)
    bad = sorted(names & set(RESERVED_TEMPLATE_KWARGS)) + sorted(names - readable if readable is not None else ())
    if bad:
        raise ParamError("chat_template_kwargs", "names this model's chat template reads, other than what the "
                         "server sets: " + (", ".join(sorted(readable or ())) or "none"), bad[0])
    return dict(kwargs or {})


def render_chat(tokenizer, messages: Any, template_kwargs: dict | None = None) -> str:
    """The prompt text of ``messages`` under ``tokenizer``'s chat template, the assistant's turn opened;
    ``template_kwargs``: extra template variables (vLLM's ``chat_template_kwargs``, e.g. ``enable_thinking``)."""
    msgs = check_messages(messages)
    template = chat_template(tokenizer)
    if template is None:
        raise ParamError("messages", "a served model with a chat template (this model's tokenizer has none: "
                         "use /v1/completions with a prompt)", "messages")
    extra = check_template_kwargs(template, template_kwargs)
    hf = getattr(tokenizer, "tok", None)
    try:
        if hf is not None:
            return hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **extra)
        from transformers.utils.chat_template_utils import render_jinja_template
        (text,), _ = render_jinja_template([msgs], chat_template=template, add_generation_prompt=True, **extra)
        return text
    except Exception as e:                     # noqa: BLE001 - a template may raise on a conversation it refuses
        if type(e).__name__ in ("TemplateError", "TemplateSyntaxError", "UndefinedError"):
            raise ParamError("messages", "a conversation this model's chat template accepts", str(e)) from None
        raise
