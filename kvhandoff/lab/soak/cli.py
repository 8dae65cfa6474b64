"""The ``kvhandoff soak`` command: flags → :class:`~kvhandoff.lab.soak.plan.Settings` → run."""

from __future__ import annotations

import argparse

DEFAULT_TRANSPORTS = ("tcp", "shm", "mooncake", "nixl")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=3.0, help="how long to run (default 3)")
    p.add_argument("--seconds", type=float, help="how long to run, in seconds (beats --minutes)")
    p.add_argument("--seed", type=int, default=0, help="seed of the requests and faults")
    p.add_argument("--transports", default="auto",
                   help="comma-separated transports (default: every usable one of "
                        f"{', '.join(DEFAULT_TRANSPORTS)})")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--chaos-every", type=float, default=8.0,
                   help="mean seconds between process faults (default 8)")
    p.add_argument("--netcut", choices=("auto", "on", "off"), default="auto",
                   help="a prefill/decode pair in two network namespaces whose link is cut "
                        "now and then (needs root and `ip netns`; auto: when both are there)")
    p.add_argument("--verbose", action="store_true",
                   help="show the workers' session warnings (peer lost, re-registration …)")
    p.add_argument("--json", metavar="PATH", default="soak.json",
                   help="where to write the results (default soak.json)")


def transports(spec: str) -> tuple[str, ...]:
    """The transports to soak: ``auto`` keeps the usable ones of the defaults."""
    from kvhandoff.transport import available_transports

    usable = {n for n, a in available_transports().items() if a.ok}
    if spec == "auto":
        return tuple(t for t in DEFAULT_TRANSPORTS if t in usable)
    names = tuple(t.strip() for t in spec.split(",") if t.strip())
    bad = [t for t in names if t not in usable]
    if bad:
        raise SystemExit(f"kvhandoff soak: transports not usable here: {', '.join(bad)} "
                         f"(see `kvhandoff transports`)")
    return names


def run(args: argparse.Namespace) -> int:
    from kvhandoff.lab.soak.plan import Settings
    from kvhandoff.lab.soak.report import render, write_json
    from kvhandoff.lab.soak.run import Soak
    from kvhandoff.lab.testing import netns

    seconds = args.seconds if args.seconds is not None else 60.0 * args.minutes
    names = transports(args.transports)
    netcut = args.netcut == "on" or (args.netcut == "auto" and "tcp" in names
                                     and netns.available()[0])
    s = Settings(seconds=seconds, seed=args.seed, transports=names,
                 concurrency=args.concurrency, chaos_every=args.chaos_every, netcut=netcut)
    import logging

    rep = Soak(s, say=lambda m: print(m, flush=True),
               log_level=logging.WARNING if args.verbose else logging.ERROR).run()
    print(render(rep))
    if args.json:
        write_json(rep, args.json)
        print(f"\nwrote {args.json}")
    return 0 if rep.ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvhandoff soak")
    add_arguments(p)
    return run(p.parse_args(argv))
