"""Bootstrap messages decoded by many threads at once, in a fresh process: the first
decode of a msgspec Struct type builds its tables, and threads that raced to build them
crashed the process (a segfault in a decode rank whose TP ranks looked their prefill up
together, under a short GIL switch interval). The decoders are now built at import."""

from __future__ import annotations

import subprocess
import sys
import textwrap

RACE = textwrap.dedent('''
    import sys, threading
    sys.setswitchinterval(1e-6)  # a switch between nearly every two bytecodes
    from kvhandoff.bootstrap import client
    record = (b'{"instance":"i","dp_size":1,"dp_rank":0,"tp_size":1,"tp_rank":0,"pp_size":1,'
              b'"pp_rank":0,"control_endpoint":"tcp://127.0.0.1:1","transport":"tcp",'
              b'"model_signature":"ab"}')
    info = (b'{"instance":"i","ready":true,"dp_size":1,"tp_size":1,"pp_size":1,'
            b'"model_signature":"ab","transport":"tcp","protocol_version":1,"ranks":['
            + record + b']}')
    go = threading.Barrier(8)
    done = []
    def lookup():
        go.wait()
        assert client.decode_as(info, client.InstanceInfo).ranks[0].tp_rank == 0
        assert client.decode_as(record, client.RankRecord).instance == "i"
        done.append(1)
    threads = [threading.Thread(target=lookup) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("OK" if len(done) == 8 else f"{8 - len(done)} threads failed")
''')


def test_threads_decoding_a_lookup_at_once_never_crash_the_process() -> None:
    """Ten fresh processes, eight threads each (before the fix about half crashed)."""
    for run in range(10):
        p = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0 and p.stdout.strip() == "OK", (run, p.returncode,
                                                                 p.stderr[-2000:])
