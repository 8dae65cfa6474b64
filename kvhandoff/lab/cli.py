"""The ``kvhandoff`` command line: a table of subcommands (:data:`COMMANDS`).

Each row names a subcommand, its help and description, how it adds its flags and how it
runs; a command's own module is imported only when that command runs (or, for those
whose flags live in their module, when the parser is built), so ``kvhandoff bootstrap``
does not load the reference engine or vLLM's demo.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvhandoff.session.config import add_timeout_arguments

BENCHMARKS = ["session", "transport", "busy", "vllm", "sglang"]

Args = argparse.Namespace
Parser = argparse.ArgumentParser


@dataclass(frozen=True, slots=True)
class Command:
    """One subcommand: its name, ``help`` (one line), ``description`` (its ``--help``
    page; ``help`` when empty), ``add`` (its flags) and ``run`` (its exit status)."""

    name: str
    help: str
    add: Callable[[Parser], None]
    run: Callable[[Args], int]
    description: str = ""


def _from(module: str, name: str) -> Callable[..., int]:
    """``module.name``, imported now (commands import their module only when used)."""
    fn: Callable[..., int] = getattr(importlib.import_module(module), name)
    return fn


def _add_demo(p: Parser) -> None:
    p.add_argument("--model",
                   help="a named tiny model (see --list-models) or a local checkpoint dir "
                        "(default qwen3_next; --layout-only: a shape, default hybrid)")
    p.add_argument("--list-models", action="store_true", help="list models and exit")
    p.add_argument("--prefill-tp", type=int, default=2, help="prefill TP size (default 2)")
    p.add_argument("--decode-tp", type=int, default=1, help="decode TP size (default 1)")
    p.add_argument("--transport", default="auto",
                   help="transport backend (default auto: cma on one host, else tcp)")
    p.add_argument("--requests", type=int, default=4, help="prompts to hand off (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=16,
                   help="greedy tokens per request (default 16)")
    p.add_argument("--chunk", type=int, default=16, help="prefill chunk tokens (default 16)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve each worker's Prometheus metrics: prefill on PORT, decode "
                        "on PORT+1 (0: any free ports); the URLs are printed")
    p.add_argument("--hold", type=float, default=0.0, metavar="SECONDS",
                   help="keep the workers (and their metrics) up this long after the run")
    p.add_argument("--trace", metavar="PATH",
                   help="keep the requests' trace here (JSON lines; `kvhandoff trace PATH` "
                        "draws it; default: $KVHANDOFF_TRACE, else a temporary file)")
    p.add_argument("--corrupt", metavar="COMPONENT", help=argparse.SUPPRESS)  # tests only
    p.add_argument("--layout-only", action="store_true",
                   help="the in-memory, layouts-only check (no model, no processes)")
    p.add_argument("--tokens", type=int, default=4096,
                   help="--layout-only: prompt tokens of the request")
    p.add_argument("--page-size", type=int, default=64, help="--layout-only: page size")
    add_timeout_arguments(p)  # --bootstrap-timeout …: both workers' SessionConfig


def _add_bootstrap(p: Parser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8998, help="port to bind (default 8998)")
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help="the deployment secret (mode 0600; default $KVHANDOFF_SECRET_FILE, "
                        "else this user's own, made on first use): registering and "
                        "deregistering must be signed with it")
    p.add_argument("--insecure", action="store_true",
                   help="no deployment secret (also KVHANDOFF_INSECURE=1): anyone who "
                        "can reach the server can register, replace or remove any rank")


def _run_bootstrap(a: Args) -> int:
    return _from("kvhandoff.bootstrap.server", "main")(
        a.host, a.port, secret_file=a.secret_file, insecure=a.insecure)


def _run_transports(a: Args) -> int:
    from kvhandoff.transport import describe_transports

    print("\n".join(describe_transports()))
    return 0


def _add_bench(p: Parser) -> None:
    p.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    p.add_argument("options", nargs=argparse.REMAINDER, help="its own flags, e.g. --quick")


def _add_proxy(p: Parser) -> None:
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill server's base URL, e.g. http://127.0.0.1:8100 "
                        "(repeat for several)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode server's base URL (repeat for several)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds each hop may take in total (default 600)")
    p.add_argument("--max-body-bytes", type=int, default=64 * 2**20,
                   help="largest request body and buffered answer (default 64 MiB)")


def _run_proxy(a: Args) -> int:
    return _from("kvhandoff.lab.vllm.proxy", "serve")(
        a.prefill, a.decode, host=a.host, port=a.port, timeout=a.timeout,
        max_body_bytes=a.max_body_bytes)


def _add_sweep(p: Parser) -> None:
    p.add_argument("--family", action="append", metavar="TYPE",
                   help="sweep only this model type (repeat for several; default: every "
                        "causal-LM model type of the installed transformers)")
    p.add_argument("--json", metavar="PATH", help="write the table as JSON")
    p.add_argument("--from-json", metavar="PATH",
                   help="do not run: reload a table written by --json")
    p.add_argument("--page", metavar="PATH",
                   help="replace the generated model list in this Markdown page (between "
                        "its family-sweep markers) with the table, e.g. docs/models.md")


def _add_status(p: Parser) -> None:
    p.add_argument("bootstrap", help="the bootstrap server (host:port or URL)")
    p.add_argument("--agent", action="append", default=[], metavar="URL",
                   help="also show this agent's metrics endpoint (repeatable; decode "
                        "agents register nowhere, so name them here)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between views")
    p.add_argument("--count", type=int, default=None, help="stop after this many views")
    p.add_argument("--json", action="store_true", help="print one snapshot as JSON")


def _run_status(a: Args) -> int:
    return _from("kvhandoff.lab.status", "main")(
        a.bootstrap, a.agent, interval=a.interval, count=a.count, as_json=a.json)


def _add_trace(p: Parser) -> None:
    p.add_argument("file", help="the trace file")
    p.add_argument("--out", default=None, help="PNG to write (default FILE.png)")
    p.add_argument("--request", action="append", default=None,
                   help="only this request id (repeatable; default: every request)")


def _flags_of(module: str) -> Callable[[Parser], None]:
    """A command whose flags its own module defines (``add_arguments``)."""
    def add(p: Parser) -> None:
        importlib.import_module(module).add_arguments(p)
    return add


def _runs(module: str, name: str) -> Callable[[Args], int]:
    """A command run by ``module.name(args)``."""
    return lambda a: _from(module, name)(a)


def _none(p: Parser) -> None:
    """A command without flags."""


COMMANDS: tuple[Command, ...] = (
    Command("demo", "hand requests from a prefill process to a decode process and verify",
            _add_demo, _runs("kvhandoff.lab.demo", "run_demo"),
            "Start a bootstrap server, a prefill instance and a decode instance as separate "
            "processes, hand a batch of prompts over, and check every request decodes the "
            "same tokens as a colocated run."),
    Command("bootstrap", "run the bootstrap (rendezvous) server", _add_bootstrap,
            _run_bootstrap),
    Command("transports", "list the transports, whether each is usable here and why", _none,
            _run_transports),
    Command("soak", "a chaos soak: kill, freeze, abort and corrupt while handing off",
            _flags_of("kvhandoff.lab.soak.cli"), _runs("kvhandoff.lab.soak.cli", "run"),
            "Run 2 prefill (TP 2) and 2 decode (TP 1) worker processes of a hybrid layout "
            "and a bootstrap server, hand requests over every usable transport while "
            "processes are killed and restarted, frozen, requests aborted and source bytes "
            "flipped; check that no wrong byte is reported as success, every request ends "
            "in time, nothing leaks and memory stays bounded. Prints progress and a "
            "summary, writes JSON; exits 1 on a broken invariant."),
    Command("bench", "run a benchmark; prints a table, writes JSON and a PNG", _add_bench,
            lambda a: int(_from(f"kvhandoff.lab.bench.{a.name}", "main")(a.options))),
    Command("vllm-proxy", "a prefill/decode proxy in front of vLLM OpenAI servers",
            _add_proxy, _run_proxy,
            "Send each /v1/completions or /v1/chat/completions request to a prefill server "
            "(max_tokens 1, kv_transfer_params do_remote_decode), then to a decode server "
            "with the kv_transfer_params prefill answered; round robin over several of "
            "each."),
    Command("sweep", "hand off a tiny model of every causal-LM family transformers ships",
            _add_sweep, _runs("kvhandoff.lab.engine.sweep_cli", "run_main"),
            "For every causal-LM model type of the installed transformers, build a tiny "
            "random-weight model and hand it off in process (TP 2→1 and 1→2), or record "
            "why it is refused at start-up or cannot be built here; print the table and "
            "optionally regenerate the models page's list."),
    Command("demo-vllm", "KvhandoffConnector vs NixlConnector in real vLLM servers",
            _flags_of("kvhandoff.lab.vllm.demo"), _runs("kvhandoff.lab.vllm.demo", "run_main"),
            "Start vLLM prefill and decode servers (a tiny hybrid model, .venv-vllm) with "
            "KvhandoffConnector, then with NixlConnector, stream prompts through kvhandoff "
            "vllm-proxy, and compare bytes, transfer time, TTFT and tokens against a local "
            "run."),
    Command("demo-sglang", "real SGLang prefill and decode servers, per transfer backend",
            _flags_of("kvhandoff.lab.sglang.demo"),
            _runs("kvhandoff.lab.sglang.demo", "run_main"),
            "Start a colocated SGLang server and, per transfer backend, SGLang prefill and "
            "decode servers behind sglang-router (tiny models, .venv-sglang); stream "
            "prompts through and show bytes per component, transfer time, TTFT and whether "
            "decode's tokens equal the colocated run's."),
    Command("status", "a live view of a deployment: its bootstrap's instances and agents",
            _add_status, _run_status,
            "Show the bootstrap server's instances and ranks and, from the agents' metrics "
            "endpoints, their live requests and failures; refreshes."),
    Command("trace", "draw requests of a KVHANDOFF_TRACE file as a timeline PNG", _add_trace,
            lambda a: _from("kvhandoff.observe.trace", "main")(a.file, a.out, a.request),
            "Read the JSON lines a run wrote with KVHANDOFF_TRACE=FILE and draw each "
            "request's phases on one time axis."),
)


def parser() -> Parser:
    """The whole command line: one subparser per row of :data:`COMMANDS`."""
    top = Parser(prog="kvhandoff", description="Hand a request's KV cache and hybrid-model "
                                               "state from prefill to decode.")
    top.add_argument("--version", action="store_true", help="print the version and exit")
    sub = top.add_subparsers(dest="command")
    for c in COMMANDS:
        c.add(sub.add_parser(c.name, help=c.help, description=c.description or None))
    return top


def main(argv: Sequence[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)
    if args.version:
        from kvhandoff import __version__

        print(__version__)
        return 0
    for c in COMMANDS:
        if c.name == args.command:
            return c.run(args)
    top.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
