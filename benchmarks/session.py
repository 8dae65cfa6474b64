"""Session benchmark (``kvhandoff bench session``): see :mod:`kvhandoff.lab.bench.session`.

    python benchmarks/session.py [--json benchmarks/results/session.json] [--quick]
"""

import sys

from kvhandoff.lab.bench.session import main

if __name__ == "__main__":
    sys.exit(main())
