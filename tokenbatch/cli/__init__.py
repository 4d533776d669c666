"""The ``tokenbatch`` command line: ``tokenbatch plan ...`` and ``tokenbatch probe ...``.

Each subcommand lives in its own module with a ``register(subparsers)``
function that adds its parser and sets ``func`` to the function that runs it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    from tokenbatch import __version__

    parser = argparse.ArgumentParser(
        prog="tokenbatch",
        description="Plan token-budget batches and find the budget that fits your model.",
    )
    parser.add_argument("--version", action="version", version=f"tokenbatch {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from tokenbatch.cli import _plan, _probe

    for module in (_plan, _probe):
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.func(args)
    except (ValueError, TypeError, KeyError, OSError) as error:
        parser.exit(2, f"tokenbatch {args.command}: error: {error}\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
