"""``kvhandoff sweep``: run the family sweep (or reload a saved one), print the table,
save it, and regenerate the models page's list from it (flags: ``kvhandoff.lab.cli``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvhandoff.lab.engine.sweep_report import load, render_markdown, render_text, save, splice


def run_main(args: argparse.Namespace) -> int:
    """0 when no family failed (token-exact, refused at start-up or not buildable)."""
    from kvhandoff.lab.engine.sweep import Result

    if args.from_json:
        rows = load(args.from_json)
    else:
        import torch
        import transformers

        from kvhandoff.lab.engine.sweep import sweep

        torch.set_num_threads(1)
        transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
        rows = sweep(args.family, progress=lambda r: print(
            f"{r.family:<28} {r.result.value:<13} {r.seconds:5.1f}s  {r.reason}",
            file=sys.stderr, flush=True))
    print(render_text(rows))
    if args.json:
        save(rows, args.json)
    if args.page:
        path = Path(args.page)
        path.write_text(splice(path.read_text(), render_markdown(rows)))
    return 1 if any(r.result is Result.FAILED for r in rows) else 0
