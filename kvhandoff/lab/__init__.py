"""The lab: what proves and shows the library, never imported by it.

The command line (:mod:`.cli`), the demos, the reference engine (:mod:`.engine`), the
model catalogue (:mod:`.shapes`), benchmarks (:mod:`.bench`), the chaos soak
(:mod:`.soak`), the live status view, the vLLM and SGLang rigs (:mod:`.vllm`,
:mod:`.sglang`), the server-process plumbing they share (:mod:`.servers`) and the test
harness (:mod:`.testing`). Everything here imports the library; nothing in the library
imports this package (a test walks the imports).
"""
