"""The deployment secret: one file shared by the bootstrap server and every agent.

Every party of one deployment reads the same file (``KVHANDOFF_SECRET_FILE``, or
``--secret-file``). Nothing uses the file's bytes directly: each use derives its own key
with :meth:`Secret.key` (HKDF-SHA256, RFC 5869, stdlib ``hmac`` only), so a key that
leaks from one use (say, a bootstrap request MAC) says nothing about another (the
control plane's or the data plane's). The purposes in use are the ``PURPOSE_*``
constants; a new use adds a new constant, never reuses one.

The file is refused, naming its path and what is wrong, when it is not a regular file,
when its mode grants the group or others any access (``chmod 600`` it), or when it is
shorter than :data:`MIN_SECRET_BYTES` (leading and trailing whitespace, such as the
newline ``openssl rand -hex 32 >file`` writes, is not counted and not used). A
:class:`Secret` never shows its bytes in ``repr`` or ``str``.

Make one with ``(umask 077; openssl rand -hex 32 > /etc/kvhandoff/secret)`` or
:func:`write_secret_file`.

**Safe without configuration.** A deployment that names no file uses the user's own
default secret (:func:`default_secret_file`): ``$XDG_RUNTIME_DIR/kvhandoff/secret``, or
``/tmp/kvhandoff-<uid>/secret`` where there is no runtime directory, in a directory of
mode 0700 that the user owns, the file created (mode 0600, 32 random bytes) by whichever
process of the user needs it first and found by every other. Processes of other users
cannot read it, so they cannot register, deregister, speak on the control plane or pass
the data plane's handshake. A deployment across hosts needs one file on every host
(copy it, or name a shared one). :func:`deployment_secret` applies the rule; only an
explicit ``insecure`` runs without a secret, and says so loudly.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
from collections.abc import Mapping

__all__ = ["MIN_SECRET_BYTES", "PURPOSE_BOOTSTRAP", "PURPOSE_CONTROL", "PURPOSE_DATA",
           "PURPOSE_REQUEST", "Secret", "SecretError", "default_secret_file",
           "deployment_secret", "write_secret_file"]

log = logging.getLogger("kvhandoff.secret")

MIN_SECRET_BYTES = 32  # e.g. 16 random bytes written as hex, or 32 raw bytes
MAX_SECRET_BYTES = 4096  # a larger file is not a secret file: refuse, do not read it
PURPOSE_BOOTSTRAP = "kvhandoff/bootstrap/request-mac/v1"  # signs bootstrap mutations
PURPOSE_CONTROL = "kvhandoff/control/message-mac/v1"  # signs control messages (control_auth)
PURPOSE_DATA = "kvhandoff/data-plane/handshake/v1"  # keys the transports' data handshakes
PURPOSE_REQUEST = "kvhandoff/request-key/v1"  # derives request keys from ids (kvhandoff.binding)

_SALT = b"kvhandoff deployment secret v1"
_HASH = hashlib.sha256
_HASH_LEN = _HASH().digest_size


class SecretError(ValueError):
    """The secret file cannot be used; the message names the path and the problem."""


class Secret:
    """The deployment secret's key material. Immutable; safe to share between threads.

    Build with :meth:`load` (a file) or :meth:`from_bytes`; derive keys with :meth:`key`.
    """

    __slots__ = ("_prk", "source")

    def __init__(self, prk: bytes, source: str) -> None:
        self._prk = prk  # HKDF-Extract of the file's bytes: the only material kept
        self.source = source  # where it came from, for messages (never the bytes)

    @classmethod
    def from_bytes(cls, material: bytes, *, source: str = "<bytes>") -> Secret:
        """A secret from raw bytes (surrounding whitespace stripped), at least
        :data:`MIN_SECRET_BYTES` long; raises :class:`SecretError` otherwise."""
        material = material.strip()
        if len(material) < MIN_SECRET_BYTES:
            raise SecretError(f"secret {source}: {len(material)} bytes, need at least "
                              f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)")
        return cls(hmac.new(_SALT, material, _HASH).digest(), source)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Secret:
        """Read the secret file at ``path``; raises :class:`SecretError` if it is missing,
        not a regular file, readable (or writable) by the group or others, empty, too
        short or too long. The mode is checked on the opened file, not the path, so a
        swap between the check and the read cannot slip a different file in."""
        name = os.fspath(path)
        try:
            # O_NONBLOCK: a FIFO put in its place must not hang the process (refused below).
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise SecretError(f"secret file {name}: cannot open: {e.strerror}") from e
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise SecretError(f"secret file {name}: not a regular file")
        with os.fdopen(fd, "rb") as f:
            mode = stat.S_IMODE(st.st_mode)
            if mode & 0o077:
                raise SecretError(f"secret file {name}: mode {mode:04o} lets the group or "
                                  f"others access it; run `chmod 600 {name}`")
            if st.st_size > MAX_SECRET_BYTES:
                raise SecretError(f"secret file {name}: {st.st_size} bytes, more than "
                                  f"{MAX_SECRET_BYTES}: not a secret file")
            data = f.read(MAX_SECRET_BYTES + 1)
        return cls.from_bytes(data, source=f"file {name}")

    def key(self, purpose: str, length: int = 32) -> bytes:
        """The key for ``purpose`` (one of the ``PURPOSE_*`` constants): HKDF-Expand of
        the secret with ``purpose`` as info. Deterministic: every holder of the same file
        derives the same key; different purposes give unrelated keys."""
        if not purpose:
            raise ValueError("a derived key needs a purpose")
        return _expand(self._prk, purpose.encode(), length)

    def __repr__(self) -> str:
        return f"Secret({self.source})"

    __str__ = __repr__


def _expand(prk: bytes, info: bytes, length: int) -> bytes:
    """HKDF-Expand (RFC 5869 section 2.3) with SHA-256."""
    if not 1 <= length <= 255 * _HASH_LEN:
        raise ValueError(f"derived key length {length} out of range")
    out, block = b"", b""
    for i in range(1, -(-length // _HASH_LEN) + 1):
        block = hmac.new(prk, block + info + bytes([i]), _HASH).digest()
        out += block
    return out[:length]


def write_secret_file(path: str | os.PathLike[str]) -> str:
    """Create a new secret file at ``path`` (mode 0600, 32 random bytes as hex); refuses
    to overwrite an existing file. Returns the path, for the throwaway secret of a demo
    or a test."""
    name = os.fspath(path)
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return name


DEFAULT_NAME = "secret"
"""The default secret's file name, in :func:`default_secret_dir`."""


def default_secret_dir(env: Mapping[str, str] | None = None) -> str:
    """Where the user's default secret lives: ``$XDG_RUNTIME_DIR/kvhandoff`` (the user's
    runtime directory, when set to an absolute path), else ``/tmp/kvhandoff-<uid>``."""
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        return os.path.join(runtime, "kvhandoff")
    return f"/tmp/kvhandoff-{os.geteuid()}"


def default_secret_file(env: Mapping[str, str] | None = None) -> str:
    """The path of the user's default deployment secret, made on first use (see the
    module docstring): the directory with mode 0700 and the file with 0600, written
    whole under another name and linked into place, so that processes starting together
    all read the same complete file. Raises :class:`SecretError` naming the directory
    when it is not one of ours (another user's, a symbolic link, open to others)."""
    folder = default_secret_dir(env)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise SecretError(f"default secret directory {folder}: cannot create: "
                          f"{e.strerror}") from e
    _check_private(folder)
    path = os.path.join(folder, DEFAULT_NAME)
    if not os.path.lexists(path):
        tmp = write_secret_file(os.path.join(folder, f".{DEFAULT_NAME}.{secrets.token_hex(8)}"))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process of ours made it first: theirs stands
        finally:
            os.unlink(tmp)
    return path


def _check_private(folder: str) -> None:
    """Refuse a directory that others could have planted, or can read or replace."""
    st = os.lstat(folder)
    why = ""
    if not stat.S_ISDIR(st.st_mode):
        why = "is not a directory (a symbolic link?)"
    elif st.st_uid != os.geteuid():
        why = f"belongs to uid {st.st_uid}, not to this user ({os.geteuid()})"
    elif stat.S_IMODE(st.st_mode) & 0o077:
        why = (f"has mode {stat.S_IMODE(st.st_mode):04o}: the group or others may "
               f"access it; run `chmod 700 {folder}`")
    if why:
        raise SecretError(f"default secret directory {folder} {why}; remove it, or name "
                          f"a secret file (KVHANDOFF_SECRET_FILE)")


_warned = threading.Event()
INSECURE_WARNING = (
    "KVHANDOFF INSECURE: running without a deployment secret (--insecure / "
    "KVHANDOFF_INSECURE): any process that reaches this deployment's ports, of any user "
    "on this host or any host that can route to it, can register and deregister ranks, "
    "abort requests, forge statuses and pass the data-plane handshake")


def deployment_secret(secret_file: str = "", *, insecure: bool = False) -> Secret | None:
    """The secret a deployment configured with ``secret_file`` / ``insecure`` uses: that
    file; else, with ``insecure``, none (a loud warning, once per process); else the
    user's default secret (:func:`default_secret_file`). Raises :class:`SecretError`
    when the file cannot be used, or both are given."""
    if secret_file and insecure:
        raise SecretError(f"both a secret file ({secret_file}) and insecure were given: "
                          "choose one")
    if secret_file:
        return Secret.load(secret_file)
    if insecure:
        if not _warned.is_set():
            _warned.set()
            log.warning(INSECURE_WARNING)
        return None
    return Secret.load(default_secret_file())


def data_key(secret_file: str | os.PathLike[str]) -> bytes | None:
    """The data-plane key (:data:`PURPOSE_DATA`) of the secret file at ``secret_file``, as
    the transports' ``data_secret`` option takes it; None when ``secret_file`` is empty
    (no deployment secret). Every place that builds a transport for an agent's config
    derives it here, so they agree. Raises :class:`SecretError` as :meth:`Secret.load`."""
    return Secret.load(secret_file).key(PURPOSE_DATA) if os.fspath(secret_file) else None
