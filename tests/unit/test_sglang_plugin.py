"""The SGLang plugin's guards, without SGLang: the version it was written against, and
the closed enums it extends only while they have the members it expects."""

from __future__ import annotations

import enum

import pytest

from kvhandoff.integrations.sglang.plugin import (
    SGLANG_VERSION,
    TRANSFER_BACKENDS,
    SglangVersionError,
    check_enum,
    check_version,
    extend_enum,
)


def test_only_the_sglang_release_it_was_written_for_is_accepted() -> None:
    check_version(SGLANG_VERSION)
    with pytest.raises(SglangVersionError, match=r"built for SGLang 0\.5\.23, but SGLang 0\.6\.0 "
                                                 r"is installed; install sglang==0\.5\.23"):
        check_version("0.6.0")


def _backends() -> type[enum.Enum]:
    return enum.Enum("TransferBackend", {v.upper(): v for v in sorted(TRANSFER_BACKENDS)})


def test_the_enum_gains_one_member_once() -> None:
    kind = _backends()
    member = extend_enum(kind, "KVHANDOFF", "kvhandoff")
    assert kind("kvhandoff") is member is kind.KVHANDOFF  # type: ignore[attr-defined]
    assert extend_enum(kind, "KVHANDOFF", "kvhandoff") is member
    assert [m.value for m in kind][-1] == "kvhandoff" and len(kind) == len(TRANSFER_BACKENDS) + 1
    check_enum(kind, TRANSFER_BACKENDS, extra="kvhandoff")  # ours, added before: still fine


def test_an_enum_of_another_shape_is_refused_naming_its_values() -> None:
    grown = enum.Enum("TransferBackend", {v.upper(): v for v in [*TRANSFER_BACKENDS, "uccl"]})
    with pytest.raises(SglangVersionError, match=r"TransferBackend has the values .*'uccl'"):
        check_enum(grown, TRANSFER_BACKENDS)
    mixed = enum.Enum("Mixed", {"A": "a"}, type=str)  # type: ignore[call-overload]
    with pytest.raises(SglangVersionError, match="no longer a plain Enum"):
        extend_enum(mixed, "B", "b")
