"""kvhandoff inside SGLang: the ``kvhandoff`` transfer backend.

Installing kvhandoff beside SGLang registers it (the ``sglang.srt.plugins`` entry point,
:mod:`.plugin`); start both servers with ``--disaggregation-transfer-backend kvhandoff``.
:mod:`.layout` and :mod:`.requests` are pure (no SGLang import); :mod:`.conn` holds the
SGLang classes and :mod:`.server` the registry SGLang's bootstrap server hosts.
"""
