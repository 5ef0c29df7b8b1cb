"""No engine process outlives its server, however the server dies (SIGKILL included).

vLLM runs its engine core and workers as child processes (``spawn`` on CPU and whenever CUDA is
initialised, ``fork`` otherwise). A SIGKILLed server runs no cleanup, so without help those children
live on, holding the GPUs and gigabytes of memory. ``PR_SET_PDEATHSIG`` does not fit: it fires when
the *thread* that created the child exits, and the backend loads in a short-lived thread.

Instead every engine-side process runs a watchdog thread (``arm``) that polls the server's identity
(pid + kernel start time, so a reused pid does not count) every ``POLL_S`` and SIGKILLs its own
process as soon as the server is gone or a zombie. Each process watches the server itself, not its
parent, so a chain of processes dies in one step. It is armed

* in ``spawn`` children while they unpickle their arguments, before any vLLM code runs:
  ``ServerIdentity`` (a ``str``) rides in the engine config, and unpickling it calls ``arm``;
* in ``fork`` children by an ``os.register_at_fork`` hook installed by ``mark_server``;
* at import of ``eagle3.server.backends.vllm_connector`` (vLLM's engine and workers load it), as a third net.

Invariant: in the server process itself ``arm`` is a no-op. Stdlib only: it runs in every child.
The handover-directory helpers name each directory after its owner (``owner_tag``) so a later
server can tell stale directories of dead servers from live ones (``remove_stale_dirs``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)
SERVER_ENV = "EAGLE3_SERVER_IDENTITY"  # "pid:starttime" of the server, inherited by every child
POLL_S = 0.5  # how often a child checks that its server is alive (worst-case orphan lifetime)
DIR_PREFIX = "eagle3-vllm-hs-"

_armed = threading.Event()
_fork_hook_installed = False


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or None when
    it does not exist or is a zombie (dead, not yet reaped). Without ``/proc``: ``"?"`` if it exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"
    fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state is fields[0]
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def identity(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_time(pid)}"


def alive(ident: str) -> bool:
    """Whether the process named by ``identity()`` output still runs (same pid, same start time)."""
    pid_text, _, started = ident.partition(":")
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    now = start_time(pid)
    return now is not None and (now == started or "?" in (now, started))


def arm(server: str | None = None) -> bool:
    """Start this process's watchdog (once) unless it is the server itself; True if armed now. Its
    own ``fork`` children get theirs too (vLLM may fork workers from the engine core)."""
    server = server or os.environ.get(SERVER_ENV)
    if not server or server.partition(":")[0] == str(os.getpid()) or _armed.is_set():
        return False
    _armed.set()
    _install_fork_hook()
    threading.Thread(target=_watch, args=(server,), name="eagle3-engine-guard", daemon=True).start()
    return True


def _watch(server: str) -> None:
    while alive(server):
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup: the server that could use it is gone


def _after_fork_in_child() -> None:
    _armed.clear()  # the parent's watchdog thread did not survive the fork
    arm()


class ServerIdentity(str):
    """The server's identity as a plain string (JSON, hashing and vLLM's config checks see a ``str``)
    that arms the watchdog in whatever process unpickles it (vLLM's ``spawn`` children)."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return _unpickle_identity, (str(self),)


def _unpickle_identity(value: str) -> ServerIdentity:
    arm(value)
    return ServerIdentity(value)


def _install_fork_hook() -> None:
    global _fork_hook_installed
    if not _fork_hook_installed:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook_installed = True


def mark_server() -> ServerIdentity:
    """Call in the server before it starts engine processes: every child inherits the identity in its
    environment and, through the fork hook, arms its watchdog."""
    ident = ServerIdentity(identity())
    os.environ[SERVER_ENV] = ident
    _install_fork_hook()
    return ident


def owner_tag() -> str:
    """``PID-STARTTIME-`` for a handover directory name: the part ``remove_stale_dirs`` checks."""
    pid, _, started = identity().partition(":")
    return f"{pid}-{started}-"


def remove_stale_dirs(root: str) -> list[str]:
    """Delete ``root``'s handover directories whose owner server is no longer running (a SIGKILLed
    server cannot delete its own); returns the paths removed. Directories of live servers, of other
    users and names this module did not make are left alone."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(DIR_PREFIX):
            continue
        pid, _, rest = entry.name[len(DIR_PREFIX) :].partition("-")
        started, _, _ = rest.partition("-")
        try:
            if not pid.isdigit() or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != os.getuid() or alive(f"{pid}:{started}"):
                continue
        except OSError:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    if removed:
        logger.info("removed %d handover dir(s) of dead servers: %s", len(removed), ", ".join(removed))
    return removed
