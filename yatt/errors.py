"""The one error tree of yatt.

Every error that crosses a module boundary is one of these, so callers can catch what they
can handle and nothing else::

    YattError
    ├── ConfigError        a bad config key or value; the message names the dotted field and the fix
    │   ├── FieldError     one field's bad value (yatt.runtime.configtools; the path grows as it rises)
    │   ├── PluginError    a 'package.module:function' value that does not load; says why, and the fix
    │   └── SlurmError     a SLURM setup problem the user fixes (launch.slurm)
    ├── LayoutError        a placement layout that cannot be laid out on the cluster (yatt.placement)
    ├── ProtocolError      a message that cannot be decoded or validated; names the field
    ├── TransportError     a socket-level failure (bind, connect, frame limits)
    │   └── PeerLost       a peer missed its heartbeats; its in-flight requests fail with this
    ├── RequestTimeout     a request got no reply in time
    ├── RemoteError        a handler on another actor raised; carries its type and traceback
    ├── ActorFailed        an actor process died or failed to start
    ├── Closed             an operation on a closed actor, stream or queue
    ├── StorageError       a durable write failed (disk full, I/O error); names the file
    └── RunStopped         a role found the run cannot go on, and a restart would not help

User mistakes raise with the fix in the message; ``assert`` is for internal invariants only.
``YattError`` and ``ProtocolError`` are defined in ``protocols.errors`` (the codec raises
them) and re-exported here.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from protocols.errors import (  # the bottom layer's, so the codec needs nothing above it
    ProtocolError,
    YattError,
)

__all__ = [
    "ActorFailed", "Closed", "ConfigError", "LayoutError", "PeerLost", "PluginError", "ProtocolError", "RemoteError",
    "RequestTimeout", "TransportError", "YattError",
]  # fmt: skip


class ConfigError(YattError):
    """A config key or value is wrong. The message names the dotted field and the fix."""


class PluginError(ConfigError):
    """A config value naming a user's function ('package.module:function') does not load:
    malformed, its module does not import, no such attribute, or not callable. The message
    names the field, the path, what went wrong and the fix (``yatt.runtime.plugins``)."""


class LayoutError(YattError):
    """A layout that cannot be laid out on the cluster's slots (too few, too small): says
    what it needs and what to change."""


class TransportError(YattError):
    """A socket-level failure: bind or connect refused, a frame over the size limit."""


class PeerLost(TransportError):
    """A peer missed too many heartbeats (or went away); its in-flight work is failed."""

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"peer {peer!r} lost: {reason}")
        self.peer = peer
        self.reason = reason


class RequestTimeout(YattError):
    """A request got no reply within its deadline."""


class RemoteError(YattError):
    """A handler on a remote actor raised. ``error_type`` and ``remote_traceback`` say what."""

    def __init__(self, peer: str, error_type: str, message: str, remote_traceback: str) -> None:
        super().__init__(f"{error_type} on {peer!r}: {message}\n--- remote traceback ---\n{remote_traceback}")
        self.peer = peer
        self.error_type = error_type
        self.remote_message = message
        self.remote_traceback = remote_traceback


class ActorFailed(YattError):
    """An actor process died, or failed before it reported READY."""


class Closed(YattError):
    """The actor, stream or queue is closed."""


class StorageError(YattError):
    """A durable write failed (disk full, I/O error): says which file and why."""


def storage_error(path: object, error: BaseException) -> StorageError:
    """A ``StorageError`` for a failed write to ``path``, in one line: the path, why (in
    plain words when the disk is full) and the free space on its file system (that of the
    nearest existing parent: a directory not made yet still tells)."""
    text = " ".join(str(error).split())
    free = _free_space(Path(str(path)))
    if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "full" in text.lower():
        return StorageError(
            f"no space left on device writing {path} ({text}); {free}: free space there, then resume "
            "(a run without a checkpoint yet: start it again)"
        )
    return StorageError(f"cannot write {path} ({type(error).__name__}: {text}); {free}")


def _free_space(path: Path) -> str:
    """'<size> free in <dir>' of the nearest existing parent of ``path`` (itself, if it exists)."""
    for where in (path, *path.parents):
        try:
            free = float(shutil.disk_usage(where).free)
        except OSError:  # not there (yet), or not ours to look at: its parent tells
            continue
        unit = "B"
        for larger in ("KiB", "MiB", "GiB", "TiB"):
            if free < 1024:
                break
            free, unit = free / 1024, larger
        return f"{free:.0f} {unit} free in {where}" if unit == "B" else f"{free:.1f} {unit} free in {where}"
    return "free space unknown"


class RunStopped(YattError):
    """A role found that the run cannot go on, and a restart would not help (dynamic sampling
    that accepts nothing): the role exits with ``RUN_STOPPED_EXIT``, the launcher stops the
    run with this message."""


RUN_STOPPED_EXIT = 3
