"""Benchmarks that ship with the package (``kvhandoff bench <name>``).

Each module has ``main(argv) -> int``: it prints a table, writes JSON and a PNG, and
measures only; the test suite asserts correctness, never timings.
"""
