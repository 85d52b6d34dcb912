"""The ``mlxpipe`` command: one subcommand per module, each imported only when it runs."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from mlxpipe.server.core.streams import GenerationFailed
from mlxpipe.server.core.transport import PipelineError

# (command, the module with its add_arguments and run, its line in `mlxpipe --help`)
COMMANDS = (
    ("serve", "mlxpipe.server.cli.serve", "the OpenAI-compatible HTTP API over a pipeline "
                                          "(no arguments: 2 local stages of the default model on 127.0.0.1:8000)"),
    ("generate", "mlxpipe.server.cli.generate", "generate text from one prompt through the pipeline"),
    ("node", "mlxpipe.shards.node", "run one stage worker that a head can drive"),
    ("plan", "mlxpipe.server.cli.plan", "plan a split of a model over nodes, from its config alone (no weights)"),
    ("status", "mlxpipe.server.cli.status", "the cluster as a table: stages, layers, memory, health, load"),
    ("nodes", "mlxpipe.server.cli.nodes", "the nodes that joined a running head (`mlxpipe node --join`)"),
    ("bench", "mlxpipe.bench.command", "tokens/s of the pipeline beside plain mlx-lm, measured side by side"),
    ("quantize", "mlxpipe.server.cli.quantize", "quantize a full-precision model folder, one layer at a time "
                                                "(what mlx_lm.convert -q writes)"),
    ("pull", "mlxpipe.server.cli.pull", "fetch and convert the embedded default model once, or download a "
                                        "Hugging Face repo into its cache"),
    ("certs", "mlxpipe.server.cli.certs", "make a small cluster's CA and node/client certificates (TLS)"),
)

EPILOG = """\
examples:
  mlxpipe serve                                  2 local stages of the default model, API on 127.0.0.1:8000
  mlxpipe node --listen 0.0.0.0:50051 --secret-file ~/.mlxpipe-secret
                                                 a stage worker on this Mac, for a head elsewhere
  mlxpipe serve --nodes mac1:50051,mac2:50051 --secret-file ~/.mlxpipe-secret --model ~/models/M
                                                 drive workers on other Macs
  mlxpipe plan --model config.json --nodes 192GB,192GB --bits 4
                                                 which layers where, and the predicted tokens/s
  mlxpipe status                                 the running cluster as a table

docs: README.md, docs/ (quick start, several Macs, benchmarking, security, reliability, architecture)
"""


class _Command(argparse.ArgumentParser):
    """A subcommand whose module, and with it the options, is loaded when the command
    is used: ``mlxpipe --help`` imports none of them (mlx, mlx-lm, FastAPI, gRPC and
    transformers take seconds to import: deferred, it saves start-up time)."""

    def __init__(self, *args, module: str = "", **kw):
        super().__init__(*args, **kw)
        self._module = module

    def _load(self) -> None:
        if self._module:
            module, self._module = importlib.import_module(self._module), ""
            module.add_arguments(self)
            self.set_defaults(fn=module.run)

    def parse_known_args(self, args=None, namespace=None):
        self._load()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._load()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (tests check docker/compose.yaml's commands against it)."""
    parser = argparse.ArgumentParser(
        prog="mlxpipe",
        description="Run a model too large for one Mac across several: layer-sharded MLX stages "
                    "streaming micro-batched activations over gRPC, behind an OpenAI-compatible API.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Command)
    for name, module, help in COMMANDS:
        sub.add_parser(name, help=help, module=module)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(message)s")
    try:
        return args.fn(args)
    except (ValueError, PipelineError, GenerationFailed) as err:
        # Errors a user can act on: the message, not a traceback (unless -v).
        if args.verbose:
            raise
        print(f"mlxpipe {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
