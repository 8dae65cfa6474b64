"""SGLang's ``sglang.srt.plugins`` entry point: makes ``kvhandoff`` a transfer backend.

SGLang loads general plugins early in every process (the launcher before it parses its
arguments, each scheduler before it reads the backend). :func:`register` then:

1. checks the SGLang version this backend was written against (:data:`SGLANG_VERSION`):
   the classes subclass SGLang's internal ``Common*`` ones, whose contract changes from
   release to release; another version is refused with a message naming both;
2. adds ``kvhandoff`` to ``--disaggregation-transfer-backend``'s choices (SGLang's public
   ``add_disagg_transfer_backend_choices``);
3. adds ``TransferBackend.KVHANDOFF`` to SGLang's closed enum, after checking that the enum
   and ``KVClassType`` still have the members this was written against;
4. wraps ``sglang.srt.disaggregation.utils.get_kv_class`` (SGLang's ``HookRegistry``,
   AROUND) so that ``kvhandoff`` resolves to :mod:`.conn`'s classes, every other backend
   as before.

Then ``--disaggregation-transfer-backend kvhandoff`` on both servers is all it takes. If
``SGLANG_PLUGINS`` is set, it must name ``kvhandoff`` in every SGLang process.
Idempotent. A refusal raises :class:`SglangVersionError` (SGLang logs it, and the CLI then
refuses ``kvhandoff`` as an unknown choice).
"""

from __future__ import annotations

import enum
import importlib.metadata
from collections.abc import Callable, Iterable
from typing import Any

from kvhandoff.errors import HandoffError

__all__ = ["BACKEND", "CLASS_TYPES", "SGLANG_VERSION", "TRANSFER_BACKENDS",
           "SglangVersionError", "check_enum", "check_version", "extend_enum", "register"]

SGLANG_VERSION = "0.5.23"
"""The SGLang release this backend is written against."""

BACKEND = "kvhandoff"
"""The backend's name: its CLI choice and ``TransferBackend`` value."""

TRANSFER_BACKENDS = frozenset({"mooncake", "mori", "nixl", "ascend", "fake"})
"""``TransferBackend``'s values in SGLang 0.5.23."""

CLASS_TYPES = frozenset({"kvargs", "manager", "sender", "receiver", "bootstrap_server"})
"""``KVClassType``'s values in SGLang 0.5.23."""

TARGET = "sglang.srt.disaggregation.utils.get_kv_class"


class SglangVersionError(HandoffError):
    """The installed SGLang is not the one this backend was written against."""


def check_version(installed: str) -> None:
    """Refuse an SGLang release other than :data:`SGLANG_VERSION`, naming both."""
    if installed != SGLANG_VERSION:
        raise SglangVersionError(
            f"kvhandoff's SGLang transfer backend is built for SGLang {SGLANG_VERSION}, but "
            f"SGLang {installed} is installed; install sglang=={SGLANG_VERSION}, or a "
            f"kvhandoff release built for SGLang {installed}")


def check_enum(kind: type[enum.Enum], expected: Iterable[str], *, extra: str = "") -> None:
    """Refuse ``kind`` unless its values are exactly ``expected`` (plus ``extra``, ours,
    if an earlier call added it)."""
    want = frozenset(expected)
    have = {str(m.value) for m in kind}
    if have - {extra} != want:
        raise SglangVersionError(
            f"SGLang's {kind.__name__} has the values {sorted(have)}, not the "
            f"{sorted(want)} kvhandoff's backend was written against (SGLang "
            f"{SGLANG_VERSION}); refusing to extend it")


def extend_enum(kind: type[enum.Enum], name: str, value: str) -> enum.Enum:
    """Add member ``name = value`` to the plain Enum ``kind`` (once; later calls return
    the member). There is no public way to extend an Enum: this sets what ``enum`` itself
    keeps (the member and value maps, the name list) and the class attribute."""
    existing = kind._value2member_map_.get(value)
    if existing is not None:
        return existing
    if any(issubclass(kind, mixin) for mixin in (int, str, float)):
        raise SglangVersionError(f"{kind.__name__} is no longer a plain Enum; refusing to "
                                 f"extend it")
    member = object.__new__(kind)
    member._name_ = name
    member._value_ = value
    kind._member_map_[name] = member
    kind._value2member_map_[value] = member
    kind._member_names_.append(name)
    type.__setattr__(kind, name, member)
    return member


def _around(classes: Callable[[], dict[str, type]]) -> Callable[..., Any]:
    """The AROUND hook of ``get_kv_class``: kvhandoff's classes for our backend (every
    class type but KVARGS, which all backends share), SGLang's own otherwise."""
    def get_kv_class(original: Callable[..., Any], transfer_backend: Any, class_type: Any,
                     *args: Any, **kwargs: Any) -> Any:
        if getattr(transfer_backend, "value", None) == BACKEND and class_type.value != "kvargs":
            return classes()[class_type.value]
        return original(transfer_backend, class_type, *args, **kwargs)
    return get_kv_class


def _classes() -> dict[str, type]:
    from kvhandoff.integrations.sglang import conn  # imports SGLang's Common classes

    return {"manager": conn.KvhandoffKVManager, "sender": conn.KvhandoffKVSender,
            "receiver": conn.KvhandoffKVReceiver,
            "bootstrap_server": conn.KvhandoffKVBootstrapServer}


_registered = False


def register() -> None:
    """The entry point (see the module docstring)."""
    global _registered
    if _registered:
        return
    check_version(importlib.metadata.version("sglang"))
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_enum(TransferBackend, TRANSFER_BACKENDS, extra=BACKEND)
    check_enum(KVClassType, CLASS_TYPES)
    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND])
    extend_enum(TransferBackend, BACKEND.upper(), BACKEND)
    HookRegistry.register(TARGET, _around(_classes), HookType.AROUND)
    _registered = True
