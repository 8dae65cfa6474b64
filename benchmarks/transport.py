"""Transport benchmark (the implementation lives in :mod:`kvhandoff.lab.bench.transport`).

    python benchmarks/transport.py [--quick] [--transports tcp,shm,mooncake,nixl]
    kvhandoff bench transport [--json PATH]      # the same, from the CLI
"""

from __future__ import annotations

import sys

from kvhandoff.lab.bench.transport import main

if __name__ == "__main__":
    sys.exit(main())
