"""Command line of cupynorm (also the `cupynorm` script):

    python -m cupynorm bench [...]     torch eager vs torch.compile vs cupynorm (a CUDA GPU)
    python -m cupynorm report [...]    the results page from the bench's JSON files
    python -m cupynorm profile [...]   where the host and GPU time of the norm layers goes

Importing this module is cheap: torch and CuPy are imported only when a command runs, so
`python -m cupynorm --help` works without them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cupynorm import bench
from cupynorm.bench import profile


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
    report_parser = commands.add_parser(
        "report",
        help="render the results page (RESULTS.md) from `bench --json` files",
        description=bench.REPORT_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_report_arguments(report_parser)
    profile_parser = commands.add_parser(
        "profile",
        help="where the norm layers' host and GPU time goes (development tool)",
        description=profile.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    profile.add_profile_arguments(profile_parser)
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
    if args.command == "report":
        return bench.run_report(args)
    if args.command == "profile":
        return profile.run_profile(args)
    parser.print_usage(sys.stderr)
    return bench.EXIT_ENVIRONMENT


if __name__ == "__main__":
    sys.exit(main())
