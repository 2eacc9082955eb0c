"""One shard service per database file: a second one, each answering from its own cached
state (read caches, owners, generations), served what the file no longer held."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from stragglers.errors import InputError


def claim(db: str | Path) -> IO[str]:
    """An exclusive lock on `<db>.lock`, held while the returned file is open (the kernel
    drops it when the process ends, kill -9 included: a restart is never refused for it);
    InputError naming the file when another service holds it."""
    # named after the file the path reaches (a symlink to it reached another lock), and
    # opened without following a link in its own place (the truncation below then wrote
    # through it into any file the service may write)
    path = f"{os.path.realpath(db)}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        f = os.fdopen(fd, "r+", encoding="utf-8")
    except OSError as exc:
        raise InputError(path, None, f"cannot open the service's lock file ({exc.strerror})"
                         ) from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read(32).strip()
        f.close()
        raise InputError(str(db), None, "another shard service serves this file"
                         + (f" (pid {holder})" if holder.isdigit() else "")
                         + "; stop it first (two on one file each answer from their own"
                         " cached state)") from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
    except OSError:
        pass   # (a full disk: the lock is what counts, the pid only names its holder)
    return f
