"""What the ``kvhandoff`` SGLang plugin does to a real SGLang, probed in SGLang's own
interpreter (lab only): ``python -m kvhandoff.lab.testing.sglang_probe WHAT`` prints one
JSON line.

* ``plugin``: SGLang's ``load_plugins()`` (the entry point, as every SGLang process runs
  it), then what ``get_kv_class`` returns for ``kvhandoff`` and for Mooncake and NIXL, in
  the module that defines it and in the ones that imported it (prefill, decode), and the
  CLI's backend choices;
* ``cli``: whether SGLang's own argument parser accepts
  ``--disaggregation-transfer-backend kvhandoff`` (``SGLANG_PLUGINS`` decides whether the
  plugin loads);
* ``version X``: the same as ``plugin`` with SGLang claiming to be version ``X``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import logging
import os
import sys
from typing import Any


def _classes() -> dict[str, Any]:
    import sglang.srt.disaggregation.decode as decode_mod
    import sglang.srt.disaggregation.prefill as prefill_mod
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    def names(fn: Any, backend: str) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for kind in KVClassType:
            cls = fn(TransferBackend(backend), kind)
            out[kind.value] = None if cls is None else f"{cls.__module__}.{cls.__name__}"
        return out

    known = [b.value for b in TransferBackend]
    report: dict[str, Any] = {"backends": known, "choices": list(DISAGG_TRANSFER_BACKEND_CHOICES)}
    if "kvhandoff" in known:
        report["kvhandoff"] = names(get_kv_class, "kvhandoff")
        report["prefill_module"] = names(prefill_mod.get_kv_class, "kvhandoff")["sender"]
        report["decode_module"] = names(decode_mod.get_kv_class, "kvhandoff")["receiver"]
        sender = get_kv_class(TransferBackend("kvhandoff"), KVClassType.SENDER)
        report["host_tensor_indices"] = sender.supports_host_tensor_indices
    for backend in ("mooncake", "nixl"):
        report[backend] = names(get_kv_class, backend)
    return report


def _load() -> str:
    """SGLang's own plugin loading; what it logged (a refusal is logged, not raised)."""
    from sglang.srt.plugins import load_plugins

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logging.getLogger("sglang.srt.plugins").addHandler(handler)
    load_plugins()
    return buf.getvalue()


def _cli() -> dict[str, Any]:
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()  # as sglang.launch_server does, before it parses
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(["--model-path", "m", "--disaggregation-transfer-backend",
                                      "kvhandoff"])
    except SystemExit as e:
        return {"accepted": False, "exit": e.code, "error": err.getvalue().strip()[-300:]}
    return {"accepted": True, "backend": args.disaggregation_transfer_backend}


def main(argv: list[str]) -> int:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from kvhandoff.lab.testing.sglang_cpu import install

    install()
    what = argv[0]
    if what == "cli":
        report = _cli()
    else:
        if what == "version":
            real, claimed = importlib.metadata.version, argv[1]

            def version(distribution_name: str) -> str:
                return claimed if distribution_name == "sglang" else real(distribution_name)

            importlib.metadata.version = version
        log = _load()
        report = {**_classes(), "log": log[-2000:]}
    print("PROBE " + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
