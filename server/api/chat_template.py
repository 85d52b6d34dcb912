"""Chat turns to prompts and replies back to messages, with the model's own means.

``Prompts.render`` puts the messages (tool calls and tool results included) and
the tools through the model's chat template, as mlx-lm's server does, with
whatever the client sent tokenized as text: a marker of the template written in
a message is plain text, never the template's token. ``Reply``
splits what the model writes into content, reasoning (between the template's
think markers) and tool calls (between its tool-call markers, parsed by the
tool parser mlx-lm picked for the template), as the text streams in: it drives
mlx-lm's ``TextStateMachine`` and ``ToolCallFormatter``.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from mlx_lm.generate import TextStateMachine, make_text_state_machine
from mlx_lm.server import ToolCallFormatter


def template_messages(messages: List[Dict[str, Any]], calls_as_text: bool = False) -> List[Dict[str, Any]]:
    """OpenAI messages as chat templates take them: tool-call arguments as objects
    (OpenAI sends them as JSON text), ``developer`` as ``system``, content always a
    string (an assistant turn that only called a tool has ``""``; templates index
    ``message['content']`` without a default). For a template that does not render
    ``tool_calls`` (``calls_as_text``), the calls are written into the content as the
    JSON the model was asked for, so the model still sees what it called."""
    out = []
    for m in messages:
        m = dict(m, role="system" if m["role"] == "developer" else m["role"], content=m.get("content") or "")
        if m.get("tool_calls"):
            m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=_arguments(c["function"]["arguments"])))
                               for c in m["tool_calls"]]
            if calls_as_text:
                calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m.pop("tool_calls")]
                written = [json.dumps(c, ensure_ascii=False) for c in calls]  # as the model writes them
                m["content"] = "\n".join([m["content"]] * bool(m["content"]) + written)
        else:
            m.pop("tool_calls", None)
        out.append(m)
    return out


def json_value(text: str) -> Any:
    """``text`` (a call's arguments, as the model wrote them) read as JSON, or a ValueError:
    as strict as a reply's JSON must be (NaN, Infinity and numbers past a float's range
    are not JSON; nor is nesting past the parser's depth)."""
    def finite(number: str) -> float:
        value = float(number)
        if not math.isfinite(value):
            raise ValueError(f"{number} is out of a float's range")
        return value

    def constant(name: str):
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(text, parse_float=finite, parse_constant=constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _arguments(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON (or nested past the parser): shown as the text it is
        return text


class Prompts:
    """Chat turns to prompt token ids, client text as text.

    A tokenizer matches its added tokens (the template's markers: ``<|im_start|>``,
    ``<think>``, ...) anywhere in the string it is given, and a chat template renders
    what clients sent (contents, tool results, names, arguments, descriptions) into
    that one string; written there, a marker would be the real token, and a client
    could forge turns or end the assistant's. So every marker string in what the
    client sent is replaced by a placeholder (a private-use character found nowhere
    in the request or the template) before rendering; the rendered string is
    tokenized as usual, so the template's own markers are its special tokens; and the
    stretches between those that hold placeholders are tokenized again, with the
    markers put back, by a copy of the tokenizer that matches no added token: they
    become plain text. Without a marker in the request the tokens are exactly
    ``apply_chat_template``'s."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        source = getattr(tokenizer, "chat_template", None) or ""
        self.template = source if isinstance(source, str) else ""
        self.calls_as_text = isinstance(source, str) and "tool_calls" not in source
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self.backend = getattr(hf, "_tokenizer", None)  # tokenizers.Tokenizer, for a fast tokenizer
        if self.backend is not None and hasattr(self.backend, "get_added_tokens_decoder"):
            added = self.backend.get_added_tokens_decoder()
        else:
            self.backend, added = None, getattr(hf, "added_tokens_decoder", None) or {}
        self.added_ids = set(added)
        # The template's markers: special tokens, and added tokens the template writes or
        # mlx-lm reads as think or tool-call markers (not a vocabulary's added words).
        known = {getattr(tokenizer, a, None) for a in ("think_start", "think_end", "tool_call_start", "tool_call_end")}
        markers = sorted({t.content for t in added.values() if t.content and (
            t.special or t.content in known or t.content in self.template)}, key=len, reverse=True)
        self.markers = re.compile("|".join(map(re.escape, markers))) if markers else None
        self._plain = None

    def render(self, messages: List[Dict[str, Any]], tools: Optional[List[dict]],
               template_kwargs: Dict[str, Any], expand: Optional[Callable[[str], str]] = None) -> List[int]:
        """The prompt's token ids: the chat template's, or the contents joined by
        newlines for a model without one. ``expand``: what the rendered text becomes before
        it is tokenized (a vision model's processor writes each image's placeholders for
        the template's marker; client text holds no marker by then)."""
        tok = self.tokenizer
        (messages, tools, template_kwargs), marked = self._escape((messages, tools, template_kwargs))
        if not tok.has_chat_template:
            text = "\n".join(m.get("content") or "" for m in messages)
            return self._encode(text, marked, add_special_tokens=True)
        text = tok.apply_chat_template(template_messages(messages, self.calls_as_text), tools=tools or None,
                                       add_generation_prompt=True, tokenize=False, **template_kwargs)
        return self._encode(expand(text) if expand is not None else text, marked, add_special_tokens=False)

    # -- client text with markers: placeholders, then plain text ------------------------------

    def _escape(self, value) -> Tuple[Any, Dict[str, str]]:
        """``value`` (messages, tools, arguments: nested lists and dicts) with every marker
        in its strings, keys included, replaced by a placeholder; and placeholder -> marker."""
        if self.markers is None:
            return value, {}
        strings: List[str] = []
        _strings(value, strings)
        found = {m for s in strings for m in self.markers.findall(s)}
        if not found:
            return value, {}
        if self.backend is None:
            raise ValueError(f"the text holds {sorted(found)[0]!r}, a marker of the chat template, which this "
                             f"tokenizer cannot encode as plain text")
        taken = "".join(strings) + self.template
        free = (chr(c) for c in range(0x10FFFD, 0x100000, -1) if chr(c) not in taken)
        placeholder = {m: next(free) for m in sorted(found)}
        return _replace(value, lambda s: self.markers.sub(lambda m: placeholder[m.group()], s)), {
            p: m for m, p in placeholder.items()}

    def _encode(self, text: str, marked: Dict[str, str], add_special_tokens: bool) -> List[int]:
        if not marked:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        enc = self.backend.encode(text, add_special_tokens=add_special_tokens)
        out: List[int] = []
        run: List[int] = []
        start = 0  # where the stretch of ordinary tokens in ``run`` begins

        def flush(end: int) -> None:
            piece = text[start:end]
            if any(p in piece for p in marked):  # client text with markers: tokenized again, as text
                restored = "".join(marked.get(ch, ch) for ch in piece)
                out.extend(self.plain().encode(restored, add_special_tokens=False).ids)
            else:
                out.extend(run)
            run.clear()

        for token, (a, b) in zip(enc.ids, enc.offsets):
            if token in self.added_ids:  # the template's own marker (offsets take in what it strips)
                flush(a)
                out.append(token)
                start = max(start, b)
            else:
                run.append(token)
        flush(len(text))
        return out

    def plain(self):
        """The tokenizer without its added tokens: special-token strings are text to it."""
        if self._plain is None:
            from tokenizers import Tokenizer

            spec = json.loads(self.backend.to_str())
            spec["added_tokens"] = []
            self._plain = Tokenizer.from_str(json.dumps(spec))
        return self._plain


def _strings(value, out: List[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _strings(k, out)
            _strings(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _strings(v, out)


def _replace(value, fn):
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {_replace(k, fn): _replace(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_replace(v, fn) for v in value)
    return value


def thinks_first(tokenizer, prompt: List[int]) -> bool:
    """The prompt opens a think block it does not close (the model starts in its reasoning)."""
    return tokenizer.has_thinking and tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: List[dict] = field(default_factory=list)


class Reply:
    """One choice's text, split as it streams into content, reasoning and tool calls."""

    def __init__(self, tokenizer, tools: Optional[List[dict]], reasoning: bool, parallel: bool, streaming: bool):
        machine = make_text_state_machine(tokenizer)
        self.where = "reasoning" if reasoning else "normal"
        self.state = machine.make_state(self.where)
        self.formatter = ToolCallFormatter(tokenizer.tool_parser, tools, streaming)
        self.parallel = parallel
        self.calls = 0
        self.tool_text = ""

    def feed(self, text: str, final: bool) -> Delta:
        """What ``text`` adds; ``final``: the reply ends with it (held-back text comes out)."""
        self.state, segments = TextStateMachine.split(self.state, text)
        if final:
            self.state, rest, now = TextStateMachine.flush(self.state)
            segments.append((now, rest))
        delta = Delta()
        for where, part in segments:
            if self.where == "tool" and where != "tool":
                self._call(delta)
            self.where = where
            if where == "tool":
                self.tool_text += part
            elif where == "reasoning":
                delta.reasoning += part
            else:
                delta.content += part
        if final and self.where == "tool" and self.tool_text:  # cut off inside a call: parse what there is
            self._call(delta)
        return delta

    def _call(self, delta: Delta) -> None:
        text, self.tool_text = self.tool_text, ""
        if self.calls and not self.parallel:
            return
        calls = self.formatter([text])
        if not self.parallel:
            calls = calls[:1]
        self.calls += len(calls)
        delta.tool_calls += calls

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return "tool_calls" if reason == "stop" and self.calls else reason


def _complete_items(text: str) -> List[Any]:
    """The items of a JSON array cut off part-way that were written whole
    (``'[{"a": 1}, {"b"'`` -> ``[{"a": 1}]``); nothing when ``text`` is not an array."""
    decoder, items, rest = json.JSONDecoder(), [], text.lstrip()
    if not rest.startswith("["):
        return items
    while True:
        try:
            item, end = decoder.raw_decode(rest[1:].lstrip())
        except json.JSONDecodeError:
            return items
        items.append(item)
        rest = rest[1:].lstrip()[end:].lstrip()
        if not rest.startswith(","):
            return items


class ForcedReply:
    """A forced tool call written as bare JSON (``structured.bare_call_grammar``), for
    a model whose chat template has no JSON tool-call markers: the whole reply is
    the call, read back into OpenAI's tool-call shape when it ends."""

    def __init__(self, functions: List[dict], parallel: bool, streaming: bool = False):
        self.functions, self.parallel, self.streaming = functions, parallel, streaming
        self.text = ""
        self.calls = 0

    @staticmethod
    def instruct(messages: List[Dict[str, Any]], functions: List[dict]) -> List[Dict[str, Any]]:
        """The messages with a system note that says which call to write and how (the
        template cannot show the model its tools); the grammar enforces it."""
        if len(functions) == 1:
            f = functions[0]
            note = (f"Answer with only the JSON arguments of a call to the function {f['name']}"
                    + (f" ({f['description']})" if f.get("description") else "")
                    + f". The arguments follow this JSON schema: {json.dumps(f.get('parameters') or {})}")
        else:
            listed = "; ".join(f"{f['name']}: {f.get('description') or ''} arguments schema "
                               f"{json.dumps(f.get('parameters') or {})}" for f in functions)
            note = f'Answer with only JSON {{"name": ..., "arguments": {{...}}}} calling one of these functions: {listed}'
        if messages and messages[0]["role"] in ("system", "developer"):
            first = dict(messages[0], content=f"{messages[0].get('content') or ''}\n\n{note}".strip())
            return [first] + messages[1:]
        return [{"role": "system", "content": note}] + messages

    def _calls(self) -> List[dict]:
        try:
            value = json.loads(self.text)
        except json.JSONDecodeError:  # cut off (max_tokens): a single function's partial arguments stay its
            if len(self.functions) == 1:
                return [{"name": self.functions[0]["name"], "arguments": self.text}]
            value = _complete_items(self.text)  # a parallel list keeps the calls written whole
        if len(self.functions) == 1:
            return [{"name": self.functions[0]["name"], "arguments": json.dumps(value, ensure_ascii=False)}]
        value = value if isinstance(value, list) else [value]
        return [{"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)} for c in value]

    def feed(self, text: str, final: bool) -> Delta:
        self.text += text
        if not final:
            return Delta()
        calls = self._calls()
        self.calls = len(calls)
        return Delta(content="" if calls else self.text, tool_calls=[
            {"function": c, "type": "function", "id": f"call_{uuid.uuid4().hex[:24]}", "index": i}
            for i, c in enumerate(calls)])

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return "tool_calls" if reason == "stop" and self.calls else reason
