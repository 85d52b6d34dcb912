"""What the head's commands share: option groups, reading them, and the plain-text table they print."""

from __future__ import annotations

import argparse
import os
from typing import Container, List, Optional

from mlxpipe.proto.rpc import Security, add_security_arguments, read_secret
from mlxpipe.server.cluster.assembly import ClusterConfig
from mlxpipe.shards.quant_spec import QuantSpec
from mlxpipe.shards.sizes import parse_size


def count(text: str) -> int:
    """An argparse type: a whole number, at least 1 (argparse turns the ValueError
    into a one-line usage error, before anything loads)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {value}")
    return value


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """Where the pipeline runs and how it is cut and batched (`serve`, `generate`)."""
    p.add_argument("--model", default="default",
                   help="mlx-lm model folder, a Hugging Face repo id (org/name: downloaded into the Hugging Face "
                        "cache when not there), or 'default' (the embedded SmolLM2-135M-Instruct, 4-bit)")
    p.add_argument("--stages", type=count, default=2,
                   help="local stage processes to start (default 2; they get a random cluster secret)")
    p.add_argument("--nodes", default="",
                   help="comma-separated host:port of running `mlxpipe node` workers, in pipeline order")
    p.add_argument("--split", default="auto",
                   help="how to cut the layers: 'auto' (default: the planner balances measured stage "
                        "times within each node's memory), 'even', or layers per stage such as 18,12")
    p.add_argument("--chunk-size", type=count, default=ClusterConfig.chunk_size,
                   help=f"prefill tokens per pipeline frame, at most (default {ClusterConfig.chunk_size}); "
                        "chunks of a long prompt flow through the stages back to back")
    p.add_argument("--groups", type=count, default=None,
                   help="micro-batch groups in flight (default: one per stage)")
    p.add_argument("--max-batch", type=count, default=ClusterConfig.max_batch,
                   help=f"sequences per micro-batch group (default {ClusterConfig.max_batch})")
    p.add_argument("--prefix-cache-bytes", default=None,
                   help="KV-cache memory per stage for prefixes of earlier requests that later ones reuse "
                        "(chat history, agents' system prompts), e.g. 2GB; 0 turns the prefix cache off "
                        "(default: half of the KV budget; cached blocks always give way to live requests)")
    p.add_argument("--prefix-block", type=count, default=ClusterConfig.block_tokens,
                   help=f"tokens per prefix-cache block (default {ClusterConfig.block_tokens}): prefixes are "
                        "reused in whole blocks")
    p.add_argument("--no-speculate", dest="speculate", action="store_false",
                   help="never verify drafted tokens (by default, while no more sequences are live than there "
                        "are stages, drafts looked up in the prompt and the text so far are verified ahead of "
                        "decoding; output is unchanged either way)")
    p.add_argument("--spec-depth", type=count, default=ClusterConfig.spec_depth,
                   help=f"drafted positions in flight per sequence, at most (default {ClusterConfig.spec_depth}; "
                        "each sequence's depth follows its acceptance)")
    p.add_argument("--draft-model", default=None,
                   help="a small model with the same tokenizer (folder, HF repo id, or 'default') that the head "
                        "runs to draft tokens where the text has nothing to copy (as mlx_lm's --draft-model); "
                        "requests choose with \"speculation\": auto, prompt_lookup, draft_model or none")
    p.add_argument("--max-waiting", type=count, default=256,
                   help="requests queued before the server answers 429 (default 256)")
    p.add_argument("--pin", action="store_true", help="pin local stage i to CPU core i (Linux)")
    p.add_argument("--bits", default=None,
                   help="quantize a full-precision --model (bf16, fp16, fp32, DeepSeek's FP8) as each stage "
                        "loads its layers, as mlx_lm.convert -q would: 8, 6, 5, 4, 3 or 2 bits, one of mlx-lm's "
                        "mixed recipes (mixed_3_6, ...), or 'auto': per layer, the most bits that fit "
                        "every node (docs/planning.md)")
    p.add_argument("--group-size", type=count, default=ClusterConfig.group_size,
                   help=f"weights per quantization scale and bias, with --bits (default {ClusterConfig.group_size})")
    add_security_arguments(p)
    p.add_argument("--weights-rate", default=None,
                   help="cap on weights streamed to each node that lacks the model, e.g. 100MB (per second)")


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """The ``ClusterConfig`` that ``add_cluster_arguments``' options describe."""
    return ClusterConfig(
        weights_rate=parse_size(args.weights_rate) if args.weights_rate else None,
        join_listen=getattr(args, "join_listen", None),
        wait_nodes=getattr(args, "wait_nodes", 0),
        security=Security.from_args(args),
        model=args.model,
        stages=args.stages,
        nodes=[n.strip() for n in args.nodes.split(",") if n.strip()],
        split=args.split,
        chunk_size=args.chunk_size,
        groups=args.groups,
        max_batch=args.max_batch,
        max_waiting=args.max_waiting,
        pin=args.pin,
        prefix_cache_bytes=_prefix_cache_bytes(args.prefix_cache_bytes),
        block_tokens=args.prefix_block,
        speculate=args.speculate,
        spec_depth=args.spec_depth,
        draft_model=args.draft_model,
        bits=_bits(args.bits),
        group_size=args.group_size,
    )


def _bits(text: Optional[str]) -> Optional[str]:
    """--bits: 'auto', or a rung (checked here, so a typo fails before anything starts)."""
    if text is None or text.strip() == "auto":
        return text and "auto"
    return QuantSpec.parse(text).bits


def _prefix_cache_bytes(text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    return 0 if text.strip() == "0" else parse_size(text)


def api_key(args: argparse.Namespace) -> str:
    """The head's API key: --api-key-file, else $MLXPIPE_API_KEY, else ""."""
    if args.api_key_file:
        return read_secret(args.api_key_file, "--api-key-file")
    return os.environ.get("MLXPIPE_API_KEY", "")


def table(rows: List[List[str]], right: Container[int] = ()) -> str:
    """Rows of cells in aligned columns; columns whose index is in ``right`` (numbers) align right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def cell(j: int, c: str) -> str:
        return c.rjust(widths[j]) if j in right else c.ljust(widths[j])

    return "\n".join("  ".join(cell(j, c) for j, c in enumerate(r)).rstrip() for r in rows)
