"""The CPU KV pools held on this host, so that every engine's pool comes out of one memory budget
(model_runner.default_kv_blocks): the pools of this process and those of the other processes of this user.

Each process keeps one small file, `<folder>/<pid>`, holding the bytes of its live pools and its start time (so a
reused pid is not counted); a pool is held from its allocation until its runner is collected or the process
ends. A reader sums the files of the other live processes and the other pools of its own process. Plain Python,
no tensors."""
import atexit
import itertools
import os
import tempfile
import threading
from pathlib import Path

_lock = threading.Lock()
_ids = itertools.count()
_held: dict[int, int] = {}          # this process's pools: handle -> bytes


def folder() -> Path:
    """Per user and host: tmpfs when there is one (gone at reboot, as the pools are)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return Path(base) / f"tidepool-kv-pools-{os.getuid() if hasattr(os, 'getuid') else 0}"


def _started(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' where /proc does not say)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _alive(pid: int, started: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not started or _started(pid) == started


def _write() -> None:
    path = folder() / str(os.getpid())
    try:
        if not _held:
            path.unlink(missing_ok=True)
            return
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(f"{sum(_held.values())} {_started(os.getpid())}\n")
        os.replace(tmp, path)
    except OSError:
        pass        # a host budget that cannot be shared across processes still holds within this one


def _forget() -> None:
    with _lock:
        _held.clear()
        _write()


def hold(nbytes: int) -> int:
    """Note a pool of `nbytes` allocated now; returns the handle release() takes."""
    with _lock:
        handle = next(_ids)
        if handle == 0:
            atexit.register(_forget)
        _held[handle] = int(nbytes)
        _write()
        return handle


def release(handle: int) -> None:
    with _lock:
        if _held.pop(handle, None) is not None:
            _write()


def held_elsewhere() -> int:
    """Bytes of the pools other engines hold on this host: this process's and the other live processes'."""
    total = 0
    here = folder()
    try:
        entries = list(here.iterdir())
    except OSError:
        entries = []
    for path in entries:
        if not path.name.isdigit() or int(path.name) == os.getpid():
            continue
        try:
            nbytes, _, started = path.read_text().strip().partition(" ")
            if _alive(int(path.name), started):
                total += int(nbytes)
            else:
                path.unlink(missing_ok=True)
        except (OSError, ValueError):
            continue
    with _lock:
        return total + sum(_held.values())
