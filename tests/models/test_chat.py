"""Chat messages rendered with the checkpoint's own template (cluster/models/chat_template.py) and the embedded
family's template (cluster/family/template_file.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.errors import ParamError
from cluster.family.template_file import TEMPLATE_FILE, ensure_chat_template
from cluster.models.chat_template import CODE_CHAT_TEMPLATE, render_chat
from cluster.models.tokenizer import ByteTokenizer, HFTokenizer
from tests.support.checkpoints import write_word_tokenizer

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add two\nnumbers"}]


def test_byte_tokenizer_renders_the_code_template():
    text = render_chat(ByteTokenizer(), MESSAGES)
    assert text == "# system: be brief\n# user: add two\n# numbers\n# assistant:\n"
    parts = [{"role": "user", "content": [{"type": "text", "text": "add "}, {"type": "text", "text": "two"}]}]
    assert render_chat(ByteTokenizer(), parts) == "# user: add two\n# assistant:\n"      # vLLM bench's shape


def test_family_template_is_written_once_and_read_by_transformers(tmp_path):
    for name in ("tokenizer", "target"):
        write_word_tokenizer(tmp_path / name, 16)
    assert HFTokenizer(tmp_path / "target").tok.chat_template is None
    with pytest.raises(ParamError) as e:                    # no template: refused, naming messages
        render_chat(HFTokenizer(tmp_path / "target"), MESSAGES)
    assert e.value.name == "messages" and "chat template" in str(e.value)
    written = ensure_chat_template(tmp_path)
    assert sorted(p.parent.name for p in written) == ["target", "tokenizer"]
    assert (tmp_path / "target" / TEMPLATE_FILE).read_text() == CODE_CHAT_TEMPLATE
    assert ensure_chat_template(tmp_path) == []             # already there: nothing rewritten
    (tmp_path / "target" / TEMPLATE_FILE).write_text("{{ messages[0]['content'] }}")   # an older version
    assert [p.parent.name for p in ensure_chat_template(tmp_path)] == ["target"]
    tok = HFTokenizer(tmp_path / "target")
    assert render_chat(tok, MESSAGES) == render_chat(ByteTokenizer(), MESSAGES)   # through apply_chat_template


@pytest.mark.parametrize("messages,words", [
    ("hi", ["non-empty list"]),
    ([], ["non-empty list"]),
    ([{"role": "wizard", "content": "x"}], ["message 0", "wizard"]),
    ([{"role": "user"}], ["message 0"]),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": 5}], ["message 1", "5"]),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], ["text parts"]),
    ([{"role": "user", "content": "\ud800"}], ["surrogate"]),
])
def test_bad_messages_name_messages(messages, words):
    with pytest.raises(ParamError) as e:
        render_chat(ByteTokenizer(), messages)
    assert e.value.name == "messages"
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_a_template_that_refuses_a_conversation_is_a_param_error(tmp_path):
    write_word_tokenizer(tmp_path, 16)
    (tmp_path / TEMPLATE_FILE).write_text("{% if messages[0]['role'] != 'user' %}"
                                          "{{ raise_exception('first message must be the user') }}{% endif %}x")
    tok = HFTokenizer(tmp_path)
    assert render_chat(tok, [{"role": "user", "content": "a"}]) == "x"
    with pytest.raises(ParamError) as e:
        render_chat(tok, [{"role": "assistant", "content": "a"}])
    assert e.value.name == "messages" and "first message must be the user" in str(e.value)
    assert render_chat(SimpleNamespace(tok=tok.tok), [{"role": "user", "content": "b"}]) == "x"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
LOOP = [{"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}], "refusal": None},   # an SDK's null extra
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def test_code_template_renders_a_tool_loop_through_transformers_too(tmp_path):
    """The family's template: tools listed, the assistant's call as the <tool_call> block the model writes (the
    hermes format), the tool's result as a message; the same through apply_chat_template(tools=...)."""
    text = render_chat(ByteTokenizer(), LOOP, tools=TOOLS)
    assert text == ('# available tool: {"name": "get_weather", "parameters": {"type": "object", "properties": '
                    '{"city": {"type": "string"}}, "required": ["city"]}}\n'
                    '# call a tool with <tool_call>, a JSON object {"name", "arguments"}, </tool_call>\n'
                    '# user: weather in Paris?\n# assistant:\n<tool_call>\n'
                    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n# tool: sunny\n'
                    '# assistant:\n')
    write_word_tokenizer(tmp_path / "tok", 16)
    ensure_chat_template(tmp_path)
    assert render_chat(HFTokenizer(tmp_path / "tok"), LOOP, tools=TOOLS) == text


@pytest.mark.parametrize("messages,words", [
    ([{"role": "tool", "content": "x"}], ["tool_call_id"]),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "not json"}}]}],
     ["arguments"]),
    ([{"role": "user", "content": "x", "audio": {"id": "a"}}], ["message 0"]),     # a non-null unknown key
])
def test_bad_tool_messages_name_messages(messages, words):
    with pytest.raises(ParamError) as e:
        render_chat(ByteTokenizer(), messages)
    assert e.value.name == "messages" and all(w in str(e.value) for w in words)
