"""Command line of cupynorm: `python -m cupynorm bench [...]` (also the `cupynorm` script).

Importing this module is cheap: torch and CuPy are imported only when a command runs, so
`python -m cupynorm --help` works without them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cupynorm import bench


def build_parser() -> argparse.ArgumentParser:
    """The `cupynorm` parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="cupynorm",
        description="Normalization layers as CUDA C kernels compiled at run time by CuPy (NVRTC).",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    bench_parser = commands.add_parser(
        "bench",
        help="benchmark torch eager vs torch.compile vs cupynorm (needs a CUDA GPU)",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_bench_arguments(bench_parser)
    return parser


def _exit_code(code: object) -> int:
    """SystemExit's code as an int (argparse: 0 after --help, 2 after a usage error)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failure, 2 usage or environment)."""
    parser = build_parser()
    try:
        args = parser.parse_args(None if argv is None else list(argv))
    except SystemExit as exc:
        return _exit_code(exc.code)
    if args.command == "bench":
        return bench.run_bench(args)
    parser.print_usage(sys.stderr)
    return bench.EXIT_ENVIRONMENT


if __name__ == "__main__":
    sys.exit(main())
