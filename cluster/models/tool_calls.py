"""Tool-call formats of the common open checkpoints: how a model writes a call, how we read it back (whole
and streamed), and the grammar that forces one (``tool_choice: required`` or a named function).

The formats and their parsing follow vLLM's tool parsers (``--tool-call-parser``), chosen per deployment by
the config's ``chat.tool_parser`` (:data:`cluster.config.schema.TOOL_PARSERS`):

* ``hermes`` (Hermes 2 Pro, Qwen 2.5 / 3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call, text before the first block is content;
* ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the whole output is ``{"name": ...,
  "parameters": {...}}`` (``arguments`` read too), several calls separated by ``; ``;
* ``mistral`` (Mistral v3 tokenizers): ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``
  (the marker is a special token that detokenising drops, so a bare list at the start is read the same).

A call comes back as (name, arguments as JSON text), OpenAI's ``function.arguments`` string.  Output that
does not parse as the format's calls is content, as in vLLM.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    name: str
    marker: str                  # the text that opens the calls
    args_key: str = "arguments"  # the key the model writes the arguments under
    at_start: bool = False       # calls only as the whole output (llama3_json), not after content

    # -- reading ---------------------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """(content or None, [(name, arguments JSON)]) of a whole output; no calls if it does not parse."""
        start = self.find(text)
        if start is None:
            return text, []
        calls = self._calls(text[start:])
        if calls is None:
            return text, []
        content = text[:start].strip()
        return content or None, calls

    def find(self, text: str) -> int | None:
        """Where the calls begin in ``text`` (None: nowhere)."""
        if self.at_start or self.name == "mistral" and text.lstrip().startswith("[{"):
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped.startswith(("{", "[{", self.marker)) else None
        i = text.find(self.marker)
        return None if i < 0 else i

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        try:
            if self.name == "hermes":
                bodies = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.DOTALL)
                objs = [json.loads(b) for b in bodies]
            elif self.name == "mistral":
                objs = json.loads(text.strip().removeprefix(self.marker).strip())
            else:
                objs, rest, dec = [], text.strip().removeprefix(self.marker), json.JSONDecoder()
                while rest:
                    obj, end = dec.raw_decode(rest)
                    objs.append(obj)
                    rest = rest[end:].strip().removeprefix(";").strip()
            out = []
            for obj in objs if isinstance(objs, list) else [None]:
                args = obj.get(self.args_key, obj.get("arguments", obj.get("parameters", {})))
                if not isinstance(obj["name"], str):
                    return None
                out.append((obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
            return out or None
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    # -- forcing ---------------------------------------------------------------------------------------
    def lark(self, tools: list[tuple[str, dict]], parallel: bool, marker_term: str, json_options: dict) -> str:
        """A Lark grammar (llguidance's dialect) of one call, or of one or more with ``parallel``, to one of
        ``tools`` = [(name, parameters schema)], in this format."""
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, self.args_key: params},
                           "required": ["name", self.args_key], "additionalProperties": False}
                          for n, params in tools], "x-guidance": json_options}
        if self.name == "mistral":
            array = {"type": "array", "items": call, "minItems": 1, "x-guidance": json_options,
                     **({} if parallel else {"maxItems": 1})}
            return f"start: {marker_term} calls\ncalls: %json {json.dumps(array)}\n"
        if self.name == "hermes":
            block = f'{marker_term} "\\n" call "\\n</tool_call>"'
            more = f' ("\\n" {block})*' if parallel else ""
            return f"start: {block}{more}\ncall: %json {json.dumps(call)}\n"
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\ncall: %json {json.dumps(call)}\n"


FORMATS = {f.name: f for f in (ToolFormat("hermes", "<tool_call>"),
                               ToolFormat("llama3_json", "<|python_tag|>", "parameters", at_start=True),
                               ToolFormat("mistral", "[TOOL_CALLS]"))}


class ToolStream:
    """A streamed output split into content (sent as it comes) and tool calls (read once it ends): text
    that may open the calls is held back, from the marker on nothing is streamed as content."""

    def __init__(self, fmt: ToolFormat):
        self.fmt, self.text, self.sent, self.start = fmt, "", 0, None

    def feed(self, text: str) -> str:
        """The content to stream now, after ``text`` arrived."""
        self.text += text
        if self.start is not None:
            return ""
        self.start = self.fmt.find(self.text)
        end = self.start if self.start is not None else len(self.text) - self._held_back()
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return "" if self.start is not None and not self.text[:self.start].strip() else out

    def finish(self) -> tuple[str, list[tuple[str, str]]]:
        """(the content still held, the calls) at the end of the output."""
        if self.start is not None:
            content, calls = self.fmt.parse(self.text)
            if calls:
                return "", calls
        out, self.sent = self.text[self.sent:], len(self.text)
        return out, []

    def _held_back(self) -> int:
        """How much of the text's end might begin the calls (and so is not streamed yet)."""
        if self.fmt.at_start or self.fmt.name == "mistral":
            head = self.text.lstrip()
            if self.sent == 0 and any(m.startswith(head) for m in ("{", "[{", self.fmt.marker)):
                return len(self.text)
            if self.fmt.at_start:
                return 0
        marker = self.fmt.marker
        for n in range(min(len(marker) - 1, len(self.text)), 0, -1):
            if self.text.endswith(marker[:n]):
                return n
        return 0
