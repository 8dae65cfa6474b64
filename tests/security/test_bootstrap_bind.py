"""Finding L8: ``kvhandoff bootstrap`` served 0.0.0.0 by default with an unauthenticated
registry. Now its default is loopback, and any other address needs a secret or an
explicit ``--insecure``."""

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


def test_cli_refuses_a_public_bind_without_a_secret(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVHANDOFF_SECRET_FILE", raising=False)
    assert cli_main(["bootstrap", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "without a deployment secret" in err and "--secret-file" in err


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
