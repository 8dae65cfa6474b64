"""``kvhandoff soak``: a chaos soak of the session layer across real processes.

Prefill and decode worker processes (hybrid layouts, heterogeneous TP) hand requests over
every usable transport while processes are killed and restarted, frozen and thawed,
requests aborted and source bytes flipped in flight; the run checks that no wrong byte is
ever reported as success, that every request ends with a status within its timeouts,
that the survivors leak nothing and that memory stays bounded.

* :mod:`~kvhandoff.lab.soak.plan` — what happens when, from a seed (pure);
* :mod:`~kvhandoff.lab.soak.pattern` — the per-request fill and where its bytes land (pure);
* :mod:`~kvhandoff.lab.soak.checker` — the verdicts and the time-to-detect table (pure);
* :mod:`~kvhandoff.lab.soak.messages` — what the parent and its workers send each other;
* :mod:`~kvhandoff.lab.soak.worker` — a worker process (the session layer's public API only);
* :mod:`~kvhandoff.lab.soak.run` — the shell: processes, chaos, progress;
* :mod:`~kvhandoff.lab.soak.report` — the summary and time-to-detect tables and the JSON;
* :mod:`~kvhandoff.lab.soak.cli` — ``kvhandoff soak``'s flags.
"""

from kvhandoff.lab.soak.plan import Settings, chaos_schedule, request_spec

__all__ = ["Settings", "chaos_schedule", "main", "request_spec"]


def main(argv: list[str] | None = None) -> int:
    from kvhandoff.lab.soak.cli import main as run_main

    return run_main(argv)
