"""From token streams to text: mlx-lm's streaming detokenizer plus stop strings.

``stream_text`` never yields half a UTF-8 character (the detokenizer holds
incomplete bytes back) and never yields any part of a stop string: text that
could still turn out to be the start of one is held until it cannot.

mlx-lm's detokenizers drop the leading space of a text's first token (SPM's and
byte-level BPE's, at the start of ``text``): right for a chat reply, which starts
a text (mlx-lm's server does the same), wrong for a continuation, whose first
token's space (" the" after "...began when") is part of what the model wrote. A
continuation is detokenized after its prompt's last tokens (``context``), flushed,
so the text the reply adds keeps every character of its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, List, Optional, Sequence

from mlxpipe.server.core.streams import RequestStream, Token

CONTEXT_TOKENS = 4  # a continued prompt's last tokens the detokenizer starts from (one that is all space is not enough)


@dataclass
class TextChunk:
    text: str                                   # new text (may be empty)
    tokens: List[Token] = field(default_factory=list)  # tokens taken since the last chunk
    finish_reason: Optional[str] = None         # set on the last chunk
    stop: Optional[str] = None                  # the stop string that ended the text, if one did


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that begins some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def detokenizer(tokenizer, context: Sequence[int] = ()):
    """mlx-lm's streaming detokenizer, and where the new text starts in its ``text``:
    after ``context`` (a continued prompt's last tokens), flushed, so that it does not
    take the new text for the start of one."""
    detok = tokenizer.detokenizer
    if not context:
        return detok, 0
    for t in context:
        detok.add_token(t)
    detok.finalize()  # (a held space or partial character is the prompt's: flushed, and left behind)
    return detok, len(detok.text)


async def stream_text(tokenizer, stream: RequestStream, stop: Sequence[str] = (),
                      context: Sequence[int] = ()) -> AsyncIterator[TextChunk]:
    """Text chunks of a request; cancels the request when a stop string appears.
    ``context``: the last tokens of the prompt the reply continues (none: it starts a text)."""
    stops = [s for s in stop if s]
    detok, emitted = detokenizer(tokenizer, context)
    eos = tokenizer.eos_token_ids
    taken: List[Token] = []
    async for token in stream:
        taken.append(token)
        finish = token.finish_reason
        if not (finish == "stop" and token.id in eos):
            detok.add_token(token.id)
        if finish is not None:
            detok.finalize()
        text = detok.text
        if stops:
            # Text before `emitted` holds no stop string, nor the start of one.
            found = [(i, s) for s in stops if (i := text.find(s, emitted)) >= 0]
            if found:
                hit, which = min(found)
                stream.cancel()
                yield TextChunk(text[emitted:hit], taken, "stop", which)
                return
        end = len(text) if finish is not None else len(text) - _held_back(text[emitted:], stops)
        chunk = TextChunk(text[emitted:end], taken, finish)  # never empty: it holds this token
        emitted = end
        taken = []
        yield chunk
        if finish is not None:
            return
    if stream.finish_reason is not None:  # it ended with no token of its own (a prompt scored only)
        yield TextChunk("", [], stream.finish_reason)
