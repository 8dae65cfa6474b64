"""The SGLang lab: real SGLang 0.5.23 servers on a CPU host (never imported by the library).

* :mod:`.env` — the SGLang venv's interpreter and the environment its processes get;
* :mod:`.standins`, :mod:`.hooks`, :mod:`.shims`, ``site/sitecustomize.py`` — strict
  stand-ins for the GPU-only packages and the CPU shims, applied only in processes the
  lab starts;
* :mod:`.models` — tiny random-weight checkpoints (Llama, Mellum, DeepSeek-V2 MLA;
  NemotronH and DeepSeek-V3.2 for boot and pool tests);
* :mod:`.serve`, :mod:`.front`, :mod:`.client` — servers, sglang-router, requests;
* :mod:`.ledger` — per-component transfer bytes from inside prefill's scheduler;
* :mod:`.rig` — deployments (prefill + decode + router) and the colocated reference,
  shared by ``tests/e2e/test_sglang.py``, ``kvhandoff demo-sglang`` (:mod:`.demo`) and
  benchmarks.
"""
