"""The ``kvhandoff`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvhandoff",
        description="Hand a request's KV cache and hybrid-model state from prefill to decode.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")

    demo = sub.add_parser("demo", help="run a verified handoff between two layouts")
    demo.add_argument("--model", default="hybrid", help="model shape (see --list-models)")
    demo.add_argument("--list-models", action="store_true", help="list model shapes and exit")
    demo.add_argument("--prefill-tp", type=int, default=2)
    demo.add_argument("--decode-tp", type=int, default=1)
    demo.add_argument("--tokens", type=int, default=4096, help="prompt tokens of the request")
    demo.add_argument("--page-size", type=int, default=64)
    demo.add_argument("--json", metavar="PATH", help="also write the summary as JSON")

    boot = sub.add_parser("bootstrap", help="run the bootstrap (rendezvous) server")
    boot.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    boot.add_argument("--port", type=int, default=8998, help="port to bind (default 8998)")

    args = parser.parse_args(argv)
    if args.version:
        from kvhandoff import __version__

        print(__version__)
        return 0
    if args.command == "demo":
        from kvhandoff.demo import run_demo

        return run_demo(args)
    if args.command == "bootstrap":
        from kvhandoff.session.bootstrap import serve

        return serve(args.host, args.port)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
