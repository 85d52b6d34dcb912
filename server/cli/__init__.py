"""The head's commands (``mlxpipe ...``): each command's module is imported only when it runs."""

from mlxpipe.server.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
