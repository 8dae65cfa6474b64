"""Checks over the project's Markdown pages (README, DEVELOPERS, ``docs/``): links and
anchors resolve (:mod:`.links`), quoted program output is still what the program prints
(:mod:`.quotes`). Text in, problems out; ``tests/unit/test_docs.py`` applies them to the
repository and ``make test`` runs it."""
