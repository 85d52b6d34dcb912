"""The ``mlxpipe`` command: one subcommand per module, each imported only when it runs."""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import re
import sys

from mlxpipe.server.core.streams import GenerationFailed
from mlxpipe.server.core.transport import PipelineError

# (command, the module with its add_arguments and run, its line in `mlxpipe --help`)
COMMANDS = (
    ("serve", "mlxpipe.server.cli.serve", "the OpenAI-compatible HTTP API over a pipeline "
                                          "(no arguments: 2 local stages of the default model on 127.0.0.1:8000)"),
    ("generate", "mlxpipe.server.cli.generate", "generate text from one prompt through the pipeline"),
    ("node", "mlxpipe.shards.worker.node", "run one stage worker that a head can drive"),
    ("plan", "mlxpipe.server.cli.plan", "plan a split of a model over nodes, from its config alone (no weights)"),
    ("status", "mlxpipe.server.cli.status", "the cluster as a table: stages, layers, memory, health, load"),
    ("nodes", "mlxpipe.server.cli.nodes",
     "the nodes a running head knows (joined, found on the LAN); with --discover, what answers on the LAN"),
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


def _did_you_mean(word: str, known) -> str:
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


class _Suggesting(argparse.ArgumentParser):
    """A parser whose usage errors name the closest valid option or command, and
    whose unknown options are refused by the (sub)command they were given to,
    with its own usage (not the top-level one)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        options = [a for a in extras if a.startswith("-")]
        if options:
            word = options[0].split("=", 1)[0]
            self.error(f"unrecognized arguments: {' '.join(extras)}{_did_you_mean(word, self._option_string_actions)}")
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def error(self, message: str):
        typo = re.search(r"invalid choice: '([^']*)'", message)
        if typo and self._subparsers is not None:
            (sub,) = [a for a in self._subparsers._group_actions if a.choices]
            message += _did_you_mean(typo.group(1), sub.choices)
        super().error(message)


class _Version(argparse.Action):
    """--version, read from the installed package's metadata when asked (not at every start)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import version

        print(f"mlxpipe {version('mlxpipe')}")
        parser.exit()


class LazyCommand(_Suggesting):
    """A subcommand whose module, and with it the options, is loaded when the command
    is used: ``mlxpipe --help`` imports none of them (mlx, mlx-lm, FastAPI, gRPC and
    transformers take seconds to import: deferred, it saves start-up time).

    A command's own subcommands are of this class too (argparse makes them of their
    parent's class), so they load as lazily: ``add_parser(name, module=..., attach=...)``,
    where ``attach(parser, module)`` adds the options of a module that is not a command
    (``mlxpipe bench``'s modes). The command names no class of the CLI's."""

    def __init__(self, *args, module: str = "", attach=None, **kw):
        super().__init__(*args, **kw)
        self._module = module
        self._attach = attach or _attach_command

    def _load(self) -> None:
        if self._module:
            module, self._module = importlib.import_module(self._module), ""
            self._attach(self, module)

    def parse_known_args(self, args=None, namespace=None):
        self._load()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._load()
        return super().format_help()


def _attach_command(parser: argparse.ArgumentParser, module) -> None:
    """Add the options of the command ``module`` is (``add_arguments``, ``run``)."""
    module.add_arguments(parser)
    parser.set_defaults(fn=module.run)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (tests check docker/compose.yaml's commands against it)."""
    parser = _Suggesting(
        prog="mlxpipe",
        description="Run a model too large for one Mac across several: layer-sharded MLX stages "
                    "streaming micro-batched activations over gRPC, behind an OpenAI-compatible API.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    parser.add_argument("--version", action=_Version, help="print mlxpipe's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=LazyCommand)
    for name, module, help in COMMANDS:
        sub.add_parser(name, help=help, module=module)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(message)s")
    logging.getLogger("mlxpipe.shards.models.progress").setLevel(logging.INFO)  # lines only where no bar shows
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
