"""The deployment secret (kvhandoff.secret) and the request MAC
(kvhandoff.bootstrap.auth), without a network: file modes, sizes, derivation
(RFC 5869 vectors), the replay window and its bounded memory."""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import pytest

from kvhandoff.bootstrap.auth import AuthRefused, Verifier, sign
from kvhandoff.secret import (
    MIN_SECRET_BYTES,
    PURPOSE_BOOTSTRAP,
    Secret,
    SecretError,
    _expand,
    write_secret_file,
)

GOOD = b"0123456789abcdef0123456789abcdef"  # 32 bytes


def _file(tmp_path: Path, data: bytes, mode: int = 0o600) -> Path:
    p = tmp_path / "secret"
    p.write_bytes(data)
    p.chmod(mode)
    return p


def test_hkdf_expand_matches_rfc5869_test_case_1() -> None:
    prk = hmac.new(bytes(range(13)), b"\x0b" * 22, hashlib.sha256).digest()
    assert prk.hex() == "077709362c2e32df0ddc3f0dc47bba6390b6c73bb50f9c3122ec844ad7c2b3e5"
    assert _expand(prk, bytes(range(0xF0, 0xFA)), 42).hex() == (
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865")


def test_write_secret_file_is_private_and_loads(tmp_path: Path) -> None:
    path = write_secret_file(tmp_path / "s")
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert Secret.load(path).key(PURPOSE_BOOTSTRAP)
    with pytest.raises(FileExistsError):
        write_secret_file(path)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644, 0o620, 0o602, 0o700 | 0o007])
def test_group_or_world_access_is_refused_naming_path_and_mode(tmp_path: Path,
                                                                mode: int) -> None:
    p = _file(tmp_path, GOOD, mode)
    with pytest.raises(SecretError) as e:
        Secret.load(p)
    assert str(p) in str(e.value) and f"{mode:04o}" in str(e.value)


@pytest.mark.parametrize("data", [b"", b"\n", b"short", GOOD[:-1] + b"\n"])
def test_empty_or_short_files_are_refused(tmp_path: Path, data: bytes) -> None:
    p = _file(tmp_path, data)
    with pytest.raises(SecretError, match=f"at least {MIN_SECRET_BYTES}") as e:
        Secret.load(p)
    assert str(p) in str(e.value)


def test_missing_directory_and_huge_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match="cannot open"):
        Secret.load(tmp_path / "absent")
    d = tmp_path / "dir"
    d.mkdir(mode=0o700)
    with pytest.raises(SecretError, match="not a regular file"):
        Secret.load(d)
    with pytest.raises(SecretError, match="not a secret file"):
        Secret.load(_file(tmp_path, b"x" * 100_000))


def test_derivation_is_deterministic_and_separated(tmp_path: Path) -> None:
    a = Secret.load(_file(tmp_path, GOOD + b"\n"))
    assert a.key(PURPOSE_BOOTSTRAP) == Secret.from_bytes(GOOD).key(PURPOSE_BOOTSTRAP)
    assert a.key("control") != a.key(PURPOSE_BOOTSTRAP) != a.key("data")
    assert Secret.from_bytes(GOOD[::-1]).key(PURPOSE_BOOTSTRAP) != a.key(PURPOSE_BOOTSTRAP)
    assert len(a.key("x", 64)) == 64 and a.key("x", 64)[:32] == a.key("x")
    assert GOOD not in a.key(PURPOSE_BOOTSTRAP)
    with pytest.raises(ValueError):
        a.key("")
    with pytest.raises(ValueError):
        a.key("x", 0)


def test_the_secret_never_shows(tmp_path: Path) -> None:
    s = Secret.load(_file(tmp_path, GOOD))
    assert GOOD.decode() not in repr(s) and GOOD.decode() not in str(s)
    assert str(tmp_path) in repr(s)


KEY = b"k" * 32
RUN = "0123456789abcdef" * 2  # the server run a request is signed for


def _check(v: Verifier, headers: dict[str, str], *, body: bytes = b"{}",
           now: float = 1000.0) -> None:
    v.check("POST", "/v1/register", body, headers, now=now)


def test_verifier_accepts_once_within_the_window() -> None:
    v = Verifier(KEY, server=RUN, window=60)
    h = sign(KEY, "POST", "/v1/register", b"{}", now=1000.0, server=RUN)
    _check(v, h, now=1030.0)
    with pytest.raises(AuthRefused, match="already used"):
        _check(v, h, now=1031.0)
    with pytest.raises(AuthRefused, match="window"):  # forgotten, but out of the window
        _check(v, h, now=1061.0)
    _check(v, sign(KEY, "POST", "/v1/register", b"{}", now=1061.0, server=RUN),
           now=1061.0)  # a new nonce
    assert v.remembered == 1  # the first one is forgotten: its timestamp left the window


def test_verifier_refuses_other_keys_methods_paths_and_bodies() -> None:
    v = Verifier(KEY, server=RUN)
    h = sign(KEY, "POST", "/v1/register", b"{}", now=1000.0, server=RUN)
    for method, path, body in (("DELETE", "/v1/register", b"{}"),
                               ("POST", "/v1/register?x=1", b"{}"),
                               ("POST", "/v1/register", b"{ }")):
        with pytest.raises(AuthRefused, match="bad signature") as e:
            v.check(method, path, body, h, now=1000.0)
        assert e.value.status == 401
    with pytest.raises(AuthRefused, match="bad signature"):
        _check(v, sign(b"x" * 32, "POST", "/v1/register", b"{}", now=1000.0, server=RUN))
    with pytest.raises(AuthRefused, match="not signed"):
        _check(v, {})


def test_verifier_memory_is_bounded_and_refuses_when_full() -> None:
    v = Verifier(KEY, server=RUN, window=10, max_remembered=3)
    for _ in range(3):
        _check(v, sign(KEY, "POST", "/v1/register", b"{}", now=1000.0, server=RUN))
    with pytest.raises(AuthRefused, match="try again") as e:
        _check(v, sign(KEY, "POST", "/v1/register", b"{}", now=1000.0, server=RUN))
    assert e.value.status == 503 and v.remembered == 3
    _check(v, sign(KEY, "POST", "/v1/register", b"{}", now=1011.0, server=RUN),
           now=1011.0)  # the others expired
    assert v.remembered == 1


def test_verifier_refuses_a_request_signed_for_another_server_run() -> None:
    """Finding "lower": a request signed for one bootstrap server (or for this one before
    it restarted) is refused by another holding the same secret, within the window."""
    h = sign(KEY, "POST", "/v1/register", b"{}", now=1000.0, server=RUN)
    _check(Verifier(KEY, server=RUN), h)
    other = Verifier(KEY, server="f" * 32)  # a second server, or this one restarted
    with pytest.raises(AuthRefused, match="another server") as e:
        _check(other, h)
    assert e.value.status == 401 and other.remembered == 0
    with pytest.raises(ValueError, match="32 hex"):
        Verifier(KEY, server="x")
