"""``mlxpipe generate``: text from one prompt through the pipeline, streamed to stdout.

It runs as the local user (``api/keys.LOCAL``: the one tenant of a server without
keys), said explicitly where it submits, so its prefixes are that tenant's in the
stages' prefix cache (whose disk tier outlives the process), as a keyless serve's are."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from dataclasses import dataclass
from typing import Optional

from mlxpipe.server import config as tree
from mlxpipe.server.config import ClusterConfig, count, knob

log = logging.getLogger("mlxpipe")


@dataclass
class GenerateOptions:
    """What ``mlxpipe generate`` takes beside the pipeline's options."""

    prompt: str = knob(help="the prompt (a user message, through the model's chat template)", flag="prompt")
    max_tokens: int = knob(256, "tokens to generate, at most (default %(default)s)", type=count)
    temp: float = knob(0.0, "sampling temperature (0: greedy)", type=float)
    top_p: float = knob(1.0, "nucleus sampling: the smallest set of tokens holding this much probability "
                        "(default %(default)s: off)", type=float)
    seed: Optional[int] = knob(None, "random seed (default: a random one)", type=int)
    no_chat: bool = knob(False, "do not apply the chat template", action="store_true")


def add_arguments(p: argparse.ArgumentParser) -> None:
    tree.add_arguments(p, ClusterConfig, serve=False)
    tree.add_arguments(p, GenerateOptions)


async def generate(config: ClusterConfig, opts: GenerateOptions) -> None:
    from mlxpipe.server.api.keys import LOCAL  # (deferred: `generate --help` needs none of them)
    from mlxpipe.server.api.textgen import CONTEXT_TOKENS, stream_text
    from mlxpipe.server.cluster.assembly import Cluster
    from mlxpipe.shards.params.sampling import Sampling

    async with Cluster(config) as cluster:
        for line in cluster.describe():
            log.info(line)
        tok = cluster.tokenizer
        continues = opts.no_chat or not tok.has_chat_template  # the reply continues the text (its first space kept)
        if continues:
            prompt = tok.encode(opts.prompt)
        else:
            prompt = tok.apply_chat_template([{"role": "user", "content": opts.prompt}], add_generation_prompt=True)
        sampling = Sampling(temperature=opts.temp, top_p=opts.top_p, seed=opts.seed)
        stream = cluster.engine.submit(prompt, opts.max_tokens, sampling, cache_salt=LOCAL.tenant(None).salt())
        n = 0
        async for chunk in stream_text(tok, stream, context=prompt[-CONTEXT_TOKENS:] if continues else ()):
            n += len(chunk.tokens)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        if stream.first_token_at and n > 1:
            secs = time.monotonic() - stream.first_token_at
            log.info("%d prompt tokens, %d generated, %.2f tokens/s after the first", len(prompt), n, (n - 1) / secs)


def run(args) -> int:
    asyncio.run(generate(tree.from_args(ClusterConfig, args), tree.from_args(GenerateOptions, args)))
    return 0
