"""Start-up of every Python process the SGLang lab launches (never installed anywhere).

:func:`kvhandoff.lab.sglang.env.lab_env` puts this directory first on ``PYTHONPATH``, so
the SGLang server and the scheduler and detokenizer processes it spawns all run this
before anything else, and get the CPU stand-ins and shims ``$KVHANDOFF_SGLANG_SHIMS``
names. A misconfiguration ends the process: running SGLang without its shims would fail
later and less clearly.
"""

try:
    from kvhandoff.lab.sglang.shims import activate

    activate()
except Exception as exc:
    raise SystemExit(f"kvhandoff lab sitecustomize: {type(exc).__name__}: {exc}") from exc
