"""Chat messages -> prompt text, with the checkpoint's own chat template (Hugging Face chat templates:
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``).

The rendered text is tokenized like any prompt (without added special tokens: the template writes its own
BOS and turn markers, as vLLM does for chat).  Messages are checked first, each refusal a :class:`ParamError`
naming ``messages``: a non-empty list of at most MAX_MESSAGES objects ``{"role", "content"}``, a role in
ROLES, a content that is a string or a list of OpenAI text parts ``[{"type": "text", "text": ...}]`` (joined;
what vLLM's ``openai-chat`` benchmark client sends), at most MAX_PROMPT_CHARS characters in all.  A tokenizer
without a chat template is refused (naming ``messages``), never given a made-up format.

Tool calling (OpenAI's shapes, as vLLM hands them to templates): a ``tool`` message carries the result of a
call (``tool_call_id``, ``content``); an assistant message may carry ``tool_calls`` (content then optional),
each ``{"id", "type": "function", "function": {"name", "arguments": JSON text}}``, its arguments parsed to
an object for the template (vLLM does the same: templates write them with ``tojson``); ``name`` is kept.
The request's ``tools`` go to the template as ``tools`` (``apply_chat_template(messages, tools=...)``).
"""
from __future__ import annotations

import functools
import json
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import meta, nodes

from cluster.errors import ParamError, check_text
from cluster.models.tokenizer import ByteTokenizer

MAX_MESSAGES = 256
MAX_CHAT_CHARS = 1 << 20          # every message's content together (cluster.engine.request.MAX_PROMPT_CHARS)
ROLES = ("system", "developer", "user", "assistant", "tool")
ALLOWED = (f"a non-empty list of at most {MAX_MESSAGES} objects {{\"role\": one of {', '.join(ROLES)}, "
           "\"content\": a string or a list of text parts} (assistant: or tool_calls; tool: and tool_call_id)")
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
CALL_SHAPE = ('tool_calls: a list of {"id": a string, "type": "function", "function": {"name": a string, '
              '"arguments": JSON object text}}')

# The template of the embedded family and of the byte-level tokenizer of the tiny test models: both are
# trained on (or stand in for) Python source, so a conversation is written as Python comments, one line per
# message line, and the generation prompt opens the assistant's turn.
# With tools: each one's function on a line, then how to call (the hermes format, cluster/models/tool_calls.py);
# an assistant turn that called tools is written as the calls the model made, a tool's result as its message.
CODE_CHAT_TEMPLATE = (
    "{% for t in tools or [] %}# available tool: {{ (t['function'] if t['function'] is defined else t) | tojson }}\n"
    "{% if loop.last %}# call a tool with <tool_call>, a JSON object {\"name\", \"arguments\"}, "
    "</tool_call>\n{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['tool_calls'] is defined and m['tool_calls'] %}# {{ m['role'] }}:\n"
    "{% for c in m['tool_calls'] %}<tool_call>\n{\"name\": {{ c['function']['name'] | tojson }}, "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>\n{% endfor %}"
    "{% else %}# {{ m['role'] }}: {{ m['content'] | replace('\\n', '\\n# ') }}\n{% endif %}{% endfor %}"
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
        calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
        if not isinstance(m, dict) or m.get("role") not in ROLES or ("content" not in m and not calls) or \
                any(v is not None for k, v in m.items() if k not in MESSAGE_KEYS):   # an SDK's null extras pass
            raise ParamError("messages", ALLOWED + f" (message {i})", m)
        content = "" if m.get("content") is None and calls else _text(m["content"], i)
        chars += len(content)
        if chars > MAX_CHAT_CHARS:
            raise ParamError("messages", f"at most {MAX_CHAT_CHARS} characters of content", f"{chars}+ characters")
        msg = {"role": m["role"], "content": content}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str) or not 0 < len(m[key]) <= 256:
                    raise ParamError("messages", f"{key}: a string of 1 to 256 characters (message {i})", m[key])
                msg[key] = m[key]
        if m["role"] == "tool" and "tool_call_id" not in msg:
            raise ParamError("messages", f"a tool message with its tool_call_id (message {i})", m)
        if calls is not None:
            msg["tool_calls"] = [_call(c, i) for c in (calls if isinstance(calls, list) else [None])]
        out.append(msg)
    return out


def _call(c: Any, i: int) -> dict:
    """One assistant tool call, its arguments parsed to an object for the template."""
    fn = c.get("function") if isinstance(c, dict) else None
    try:
        args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else None
        if not (isinstance(c.get("id"), str) and c.get("type", "function") == "function" and
                isinstance(fn["name"], str) and isinstance(args, dict)):
            raise TypeError
    except (TypeError, KeyError, ValueError):
        raise ParamError("messages", CALL_SHAPE + f" (message {i})", c) from None
    return {"id": c["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}}


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


@functools.lru_cache(maxsize=16)
def template_uses(template: str) -> dict[str, frozenset[str]] | None:
    """The variables a chat template reads (those Jinja's ``meta.find_undeclared_variables`` finds in its syntax
    tree, parsed with the extensions transformers compiles templates with), each with how it is used: ``bool``
    (a truth value: ``if x``, ``not x``, ``x is false``, ``x == true``), ``str`` (compared with text:
    ``x == "high"``), ``neutral`` (``x is defined``, ``x is none``) or ``other`` (printed, filtered, iterated, ...).
    None when it does not parse here (then the template itself decides when it is rendered)."""
    try:
        ast = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(template)
    except jinja2.TemplateSyntaxError:
        return None
    uses: dict[str, set[str]] = {}
    _walk(ast, "other", uses)
    return {name: frozenset(uses.get(name, {"other"})) for name in meta.find_undeclared_variables(ast)}


_NEUTRAL_TESTS, _BOOL_TESTS = ("defined", "undefined", "none"), ("true", "false", "boolean")


def _walk(node, ctx: str, uses: dict[str, set[str]]) -> None:
    """Record in ``uses`` how each name under ``node`` is used, ``ctx`` being how ``node`` itself is."""
    if isinstance(node, nodes.Name):
        if node.ctx == "load":
            uses.setdefault(node.name, set()).add(ctx)
        return
    if isinstance(node, nodes.If):                   # the test is a truth value, the body is not
        children = [(node.test, "bool")] + [(c, "other") for c in node.iter_child_nodes() if c is not node.test]
    elif isinstance(node, nodes.CondExpr):           # the branches are used as the whole expression is
        children = [(node.test, "bool"), (node.expr1, ctx)] + ([(node.expr2, ctx)] if node.expr2 else [])
    elif isinstance(node, nodes.Not):
        children = [(node.node, "bool")]
    elif isinstance(node, (nodes.And, nodes.Or)):   # truth values in a test, else values
        children = [(node.left, ctx if ctx == "bool" else "other"), (node.right, ctx if ctx == "bool" else "other")]
    elif isinstance(node, nodes.Test):
        kind = "neutral" if node.name in _NEUTRAL_TESTS else "bool" if node.name in _BOOL_TESTS else "other"
        children = [(node.node, kind)] + [(c, "other") for c in node.iter_child_nodes() if c is not node.node]
    elif isinstance(node, nodes.Compare):            # compared with constants of one kind: that kind
        sides = [node.expr] + [op.expr for op in node.ops]
        consts = [c.value for c in sides if isinstance(c, nodes.Const)]
        kind = "other" if not consts else "bool" if all(isinstance(v, bool) for v in consts) else \
            "str" if all(isinstance(v, str) for v in consts) else "other"
        children = [(c, kind if isinstance(c, nodes.Name) else "other") for c in sides]
    else:
        children = [(c, "other") for c in node.iter_child_nodes()]
    for child, how in children:
        _walk(child, how, uses)


def expected_type(used: frozenset[str]) -> type | None:
    """What a variable used as ``used`` (:func:`template_uses`) must be: a boolean where the template only tests
    its truth, text where it only compares it with text (and tests it), else anything (None)."""
    if "other" in used:
        return None
    return str if "str" in used else bool if "bool" in used else None


def check_template_kwargs(template: str, kwargs: dict | None) -> dict:
    """``kwargs`` (``chat_template_kwargs``) as the template is rendered with them: a name the template never
    reads is dropped, as vLLM does (agent frameworks send switches such as ``enable_thinking`` to every server;
    Jinja would ignore it anyway); a name the server sets itself is refused, and so is a value of the type the
    template cannot read (a string for a switch it only tests, :func:`expected_type`): Jinja would read any text
    as true, silently."""
    names = set(kwargs or {})
    uses = template_uses(template)
    reserved = sorted(names & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ParamError("chat_template_kwargs", "template variables other than what the server sets: not "
                         + ", ".join(RESERVED_TEMPLATE_KWARGS), reserved[0])
    if uses is None:
        return dict(kwargs or {})
    out = {}
    for name in sorted(names & set(uses)):
        value, want = kwargs[name], expected_type(uses[name])
        if want is not None and value is not None and type(value) is not want:
            raise ParamError("chat_template_kwargs", f"{name}: {'true or false' if want is bool else 'a string'} "
                             f"(this model's chat template reads it as {'a switch' if want is bool else 'text'})",
                             value)
        out[name] = value
    return out


def render_chat(tokenizer, messages: Any, *, template_kwargs: dict | None = None,
                tools: list[dict] | None = None) -> str:
    """The prompt text of ``messages`` under ``tokenizer``'s chat template, the assistant's turn opened;
    ``template_kwargs``: extra template variables (vLLM's ``chat_template_kwargs``, e.g. ``enable_thinking``);
    ``tools`` (OpenAI's ``tools``, already checked) are the template's ``tools``."""
    msgs = check_messages(messages)
    template = chat_template(tokenizer)
    if template is None:
        raise ParamError("messages", "a served model with a chat template (this model's tokenizer has none: "
                         "use /v1/completions with a prompt)", "messages")
    extra = check_template_kwargs(template, template_kwargs)
    hf = getattr(tokenizer, "tok", None)
    try:
        if hf is not None:
            return hf.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False, **extra)
        from transformers.utils.chat_template_utils import render_jinja_template
        (text,), _ = render_jinja_template([msgs], tools=tools, chat_template=template, add_generation_prompt=True,
                                           **extra)
        return text
    except Exception as e:                     # noqa: BLE001 - a template may raise on a conversation it refuses
        if type(e).__name__ in ("TemplateError", "TemplateSyntaxError", "UndefinedError"):
            raise ParamError("messages", "a conversation this model's chat template accepts", str(e)) from None
        raise
