"""The parser of every verb and the one rule for user errors: one line on stderr, exit status 2."""

from __future__ import annotations

import argparse
import sys

from .. import stage
from . import commands, neuzip


class UsageError(ValueError):
    """An argument argparse refused; ``prog`` names the verb it belongs to."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog


class OneLineParser(argparse.ArgumentParser):
    """argparse prints the whole usage block before its error; a user error here is one line."""

    def error(self, message):
        raise UsageError(self.prog, f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="thrifty", description="thrifty: cheaper LLM training and serving")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    commands.add_setup(verbs)
    commands.add_demo(verbs)
    commands.add_optimize(verbs)
    commands.add_pretrain(verbs)
    commands.add_eval(verbs)
    neuzip.add_compress(verbs)
    neuzip.add_decompress(verbs)
    stage.add_arguments(verbs.add_parser("stage", help="stage model + corpus onto the GPU box in parts",
                                         description=stage.__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter))
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as err:
        return _user_error(err.prog, err)
    try:
        return args.run(args)
    except (ValueError, OSError) as err:  # thrifty's checks and missing files; anything else is a bug: traceback
        return _user_error(f"thrifty {args.verb}", err)


def _user_error(prog: str, err: Exception) -> int:
    print(f"{prog}: {err}", file=sys.stderr)
    return 2
