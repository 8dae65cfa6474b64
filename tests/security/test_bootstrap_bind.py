"""Finding L8: ``kvhandoff bootstrap`` served 0.0.0.0 by default with an unauthenticated
registry. Now its default is loopback, and it always has a secret (the one named, else
the user's default one) unless told ``--insecure``, which it then says loudly; an
unauthenticated registry on any other address needs that flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvhandoff.bootstrap.client import BootstrapError
from kvhandoff.bootstrap.server import check_bind, main
from kvhandoff.lab.cli import main as cli_main
from kvhandoff.secret import Secret


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_loopback_needs_no_secret(host: str) -> None:
    check_bind(host, secret=None, insecure=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "10.0.0.3", "bootstrap.example"])
def test_other_addresses_need_a_secret_or_insecure(host: str, secret_file: str) -> None:
    with pytest.raises(BootstrapError, match="--insecure"):
        check_bind(host, secret=None, insecure=False)
    check_bind(host, secret=Secret.load(secret_file), insecure=False)
    check_bind(host, secret=None, insecure=True)


def _first_lines(args: list[str], env: dict[str, str]) -> tuple[str, str]:
    """The line ``kvhandoff bootstrap`` prints once it listens, and its stderr so far."""
    import os
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "kvhandoff.lab.cli", "bootstrap",
                             "--port", "0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, **env}, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()  # bounded: the process prints it, or exits
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait(30)
    return line, err


def test_cli_signs_by_default_and_says_so_loudly_when_insecure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #30 item 2: with nothing configured it requires signed registrations (the
    user's default secret), on any address; --insecure or KVHANDOFF_INSECURE=1 drops
    that, with a warning at start-up."""
    plain = {"KVHANDOFF_SECRET_FILE": "", "KVHANDOFF_INSECURE": "0"}
    line, err = _first_lines(["--host", "0.0.0.0"], plain)
    assert "(registrations signed)" in line and "INSECURE" not in err, (line, err)
    for args, env in ((["--insecure"], plain), ([], {**plain, "KVHANDOFF_INSECURE": "1"})):
        line, err = _first_lines(args, env)
        assert "(UNAUTHENTICATED)" in line and "KVHANDOFF INSECURE" in err, (line, err)


def test_cli_refuses_an_open_secret_file(capsys: pytest.CaptureFixture[str],
                                         secret_file: str) -> None:
    Path(secret_file).chmod(0o640)
    assert cli_main(["bootstrap", "--port", "0", "--secret-file", secret_file]) == 2
    err = capsys.readouterr().err
    assert secret_file in err and "0640" in err


def test_secret_file_from_the_environment_is_checked(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    monkeypatch.setenv("KVHANDOFF_SECRET_FILE", str(tmp_path / "absent"))
    assert main("0.0.0.0", 0, secret_file=None, insecure=False) == 2
    assert "absent" in capsys.readouterr().err


def test_default_host_is_loopback(capsys: pytest.CaptureFixture[str]) -> None:
    import inspect

    from kvhandoff.bootstrap import server as bootstrap

    assert inspect.signature(bootstrap.serve).parameters["host"].default == "127.0.0.1"
    with pytest.raises(SystemExit):
        cli_main(["bootstrap", "--help"])
    assert "default 127.0.0.1" in " ".join(capsys.readouterr().out.split())
