"""The ``kvhandoff`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvhandoff.session.config import add_timeout_arguments

BENCHMARKS = ["session", "transport", "vllm", "sglang"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvhandoff",
        description="Hand a request's KV cache and hybrid-model state from prefill to decode.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")

    demo = sub.add_parser(
        "demo", help="hand requests from a prefill process to a decode process and verify",
        description="Start a bootstrap server, a prefill instance and a decode instance as "
                    "separate processes, hand a batch of prompts over, and check every "
                    "request decodes the same tokens as a colocated run.")
    demo.add_argument("--model",
                      help="a named tiny model (see --list-models) or a local checkpoint dir "
                           "(default qwen3_next; --layout-only: a shape, default hybrid)")
    demo.add_argument("--list-models", action="store_true", help="list models and exit")
    demo.add_argument("--prefill-tp", type=int, default=2, help="prefill TP size (default 2)")
    demo.add_argument("--decode-tp", type=int, default=1, help="decode TP size (default 1)")
    demo.add_argument("--transport", default="auto",
                      help="transport backend (default auto: cma on one host, else tcp)")
    demo.add_argument("--requests", type=int, default=4, help="prompts to hand off (default 4)")
    demo.add_argument("--max-new-tokens", type=int, default=16,
                      help="greedy tokens per request (default 16)")
    demo.add_argument("--chunk", type=int, default=16, help="prefill chunk tokens (default 16)")
    demo.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    demo.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                      help="serve each worker's Prometheus metrics: prefill on PORT, decode "
                           "on PORT+1 (0: any free ports); the URLs are printed")
    demo.add_argument("--hold", type=float, default=0.0, metavar="SECONDS",
                      help="keep the workers (and their metrics) up this long after the run")
    demo.add_argument("--trace", metavar="PATH",
                      help="keep the requests' trace here (JSON lines; `kvhandoff trace PATH` "
                           "draws it; default: $KVHANDOFF_TRACE, else a temporary file)")
    demo.add_argument("--corrupt", metavar="COMPONENT", help=argparse.SUPPRESS)  # tests only
    demo.add_argument("--layout-only", action="store_true",
                      help="the in-memory, layouts-only check (no model, no processes)")
    demo.add_argument("--tokens", type=int, default=4096,
                      help="--layout-only: prompt tokens of the request")
    demo.add_argument("--page-size", type=int, default=64, help="--layout-only: page size")
    add_timeout_arguments(demo)  # --bootstrap-timeout …: both workers' SessionConfig

    boot = sub.add_parser("bootstrap", help="run the bootstrap (rendezvous) server")
    boot.add_argument("--host", default="127.0.0.1",
                      help="address to bind (default 127.0.0.1)")
    boot.add_argument("--port", type=int, default=8998, help="port to bind (default 8998)")
    boot.add_argument("--secret-file", default=None, metavar="PATH",
                      help="the deployment secret (mode 0600; default $KVHANDOFF_SECRET_FILE, "
                           "else this user's own, made on first use): registering and "
                           "deregistering must be signed with it")
    boot.add_argument("--insecure", action="store_true",
                      help="no deployment secret (also KVHANDOFF_INSECURE=1): anyone who "
                           "can reach the server can register, replace or remove any rank")

    sub.add_parser("transports", help="list the transports, whether each is usable here and why")

    from kvhandoff.lab.soak.cli import add_arguments as add_soak_arguments

    soak = sub.add_parser(
        "soak", help="a chaos soak: kill, freeze, abort and corrupt while handing off",
        description="Run 2 prefill (TP 2) and 2 decode (TP 1) worker processes of a hybrid "
                    "layout and a bootstrap server, hand requests over every usable "
                    "transport while processes are killed and restarted, frozen, requests "
                    "aborted and source bytes flipped; check that no wrong byte is reported "
                    "as success, every request ends in time, nothing leaks and memory stays "
                    "bounded. Prints progress and a summary, writes JSON; exits 1 on a "
                    "broken invariant.")
    add_soak_arguments(soak)

    bench = sub.add_parser("bench", help="run a benchmark; prints a table, writes JSON and a PNG")
    bench.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    bench.add_argument("options", nargs=argparse.REMAINDER, help="its own flags, e.g. --quick")

    proxy = sub.add_parser(
        "vllm-proxy", help="a prefill/decode proxy in front of vLLM OpenAI servers",
        description="Send each /v1/completions or /v1/chat/completions request to a prefill "
                    "server (max_tokens 1, kv_transfer_params do_remote_decode), then to a "
                    "decode server with the kv_transfer_params prefill answered; round robin "
                    "over several of each.")
    proxy.add_argument("--prefill", action="append", required=True, metavar="URL",
                       help="a prefill server's base URL, e.g. http://127.0.0.1:8100 "
                            "(repeat for several)")
    proxy.add_argument("--decode", action="append", required=True, metavar="URL",
                       help="a decode server's base URL (repeat for several)")
    proxy.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    proxy.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    proxy.add_argument("--timeout", type=float, default=600.0,
                       help="seconds each hop may take in total (default 600)")
    proxy.add_argument("--max-body-bytes", type=int, default=64 * 2**20,
                       help="largest request body and buffered answer (default 64 MiB)")

    sweep = sub.add_parser(
        "sweep", help="hand off a tiny model of every causal-LM family transformers ships",
        description="For every causal-LM model type of the installed transformers, build a "
                    "tiny random-weight model and hand it off in process (TP 2→1 and 1→2), "
                    "or record why it is refused at start-up or cannot be built here; print "
                    "the table and optionally regenerate the models page's list.")
    sweep.add_argument("--family", action="append", metavar="TYPE",
                       help="sweep only this model type (repeat for several; default: every "
                            "causal-LM model type of the installed transformers)")
    sweep.add_argument("--json", metavar="PATH", help="write the table as JSON")
    sweep.add_argument("--from-json", metavar="PATH",
                       help="do not run: reload a table written by --json")
    sweep.add_argument("--page", metavar="PATH",
                       help="replace the generated model list in this Markdown page (between "
                            "its family-sweep markers) with the table, e.g. docs/models.md")

    from kvhandoff.lab.vllm.demo import add_arguments as add_demo_vllm_arguments

    demo_vllm = sub.add_parser(
        "demo-vllm", help="KvhandoffConnector vs NixlConnector in real vLLM servers",
        description="Start vLLM prefill and decode servers (a tiny hybrid model, "
                    ".venv-vllm) with KvhandoffConnector, then with NixlConnector, stream "
                    "prompts through kvhandoff vllm-proxy, and compare bytes, transfer time, "
                    "TTFT and tokens against a local run.")
    add_demo_vllm_arguments(demo_vllm)

    from kvhandoff.lab.sglang.demo import add_arguments as add_demo_sglang_arguments

    demo_sglang = sub.add_parser(
        "demo-sglang", help="real SGLang prefill and decode servers, per transfer backend",
        description="Start a colocated SGLang server and, per transfer backend, SGLang "
                    "prefill and decode servers behind sglang-router (tiny models, "
                    ".venv-sglang); stream prompts through and show bytes per component, "
                    "transfer time, TTFT and whether decode's tokens equal the colocated "
                    "run's.")
    add_demo_sglang_arguments(demo_sglang)

    status = sub.add_parser(
        "status", help="a live view of a deployment: its bootstrap's instances and agents",
        description="Show the bootstrap server's instances and ranks and, from the agents' "
                    "metrics endpoints, their live requests and failures; refreshes.")
    status.add_argument("bootstrap", help="the bootstrap server (host:port or URL)")
    status.add_argument("--agent", action="append", default=[], metavar="URL",
                        help="also show this agent's metrics endpoint (repeatable; decode "
                             "agents register nowhere, so name them here)")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between views")
    status.add_argument("--count", type=int, default=None, help="stop after this many views")
    status.add_argument("--json", action="store_true", help="print one snapshot as JSON")

    trace = sub.add_parser(
        "trace", help="draw requests of a KVHANDOFF_TRACE file as a timeline PNG",
        description="Read the JSON lines a run wrote with KVHANDOFF_TRACE=FILE and draw "
                    "each request's phases on one time axis.")
    trace.add_argument("file", help="the trace file")
    trace.add_argument("--out", default=None, help="PNG to write (default FILE.png)")
    trace.add_argument("--request", action="append", default=None,
                       help="only this request id (repeatable; default: every request)")

    args = parser.parse_args(argv)
    if args.version:
        from kvhandoff import __version__

        print(__version__)
        return 0
    if args.command == "demo":
        from kvhandoff.lab.demo import run_demo

        return run_demo(args)
    if args.command == "sweep":
        from kvhandoff.lab.engine.sweep_cli import run_main as run_sweep

        return run_sweep(args)
    if args.command == "bench":
        import importlib

        return int(importlib.import_module(f"kvhandoff.lab.bench.{args.name}").main(args.options))
    if args.command == "transports":
        from kvhandoff.transport import describe_transports

        print("\n".join(describe_transports()))
        return 0
    if args.command == "soak":
        from kvhandoff.lab.soak.cli import run as run_soak

        return run_soak(args)
    if args.command == "bootstrap":
        from kvhandoff.bootstrap.server import main as bootstrap_main

        return bootstrap_main(args.host, args.port, secret_file=args.secret_file,
                              insecure=args.insecure)
    if args.command == "vllm-proxy":
        from kvhandoff.lab.vllm.proxy import serve as serve_proxy

        return serve_proxy(args.prefill, args.decode, host=args.host, port=args.port,
                           timeout=args.timeout, max_body_bytes=args.max_body_bytes)
    if args.command == "status":
        from kvhandoff.lab.status import main as status_main

        return status_main(args.bootstrap, args.agent, interval=args.interval,
                           count=args.count, as_json=args.json)
    if args.command == "trace":
        from kvhandoff.observe.trace import main as trace_main

        return trace_main(args.file, args.out, args.request)
    if args.command == "demo-vllm":
        from kvhandoff.lab.vllm.demo import run_main as run_demo_vllm

        return run_demo_vllm(args)
    if args.command == "demo-sglang":
        from kvhandoff.lab.sglang.demo import run_main as run_demo_sglang

        return run_demo_sglang(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
