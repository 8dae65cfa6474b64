"""Busy-engine benchmark (``kvhandoff bench busy``): see :mod:`kvhandoff.lab.bench.busy`.

    python benchmarks/busy.py [--json benchmarks/results/busy.json] [--quick]
"""

import sys

from kvhandoff.lab.bench.busy import main

if __name__ == "__main__":
    sys.exit(main())
