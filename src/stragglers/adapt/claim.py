"""One shard service per database file: a second one, each answering from its own cached
state (read caches, owners, generations), served what the file no longer held."""

from __future__ import annotations

import logging
from pathlib import Path

from stragglers.errors import InputError
from stragglers.file_claim import FileClaim, Held, claim_file

log = logging.getLogger(__name__)


class Claim:
    """The exclusive flock of a database file, held while this is open (close() drops it)."""

    def __init__(self, held: FileClaim | None):
        self.held = held

    def close(self) -> None:
        """Give up the claim (after the store's connections are closed)."""
        if self.held is not None:
            self.held.close()
            self.held = None


def claim(db: str | Path) -> Claim:
    """An exclusive flock on the database file itself (its inode), held while the returned
    Claim is open; the kernel drops it when the process ends, kill -9 included, so a restart
    is never refused for it. InputError naming the file when another service holds it.

    Was a lock file named after the path the --db reached: a hard link to the database, or the
    same file through a bind mount, reached another lock name and a second service started on
    the one file. A refused claim keeps its descriptor (stragglers.file_claim: closing it
    dropped the serving connections' SQLite locks, and the live WAL was deleted)."""
    try:
        held = claim_file(db)
    except Held as exc:
        raise InputError(str(db), None, "another shard service serves this file"
                         + (f" (pid {exc.pid})" if exc.pid else "")
                         + "; stop it first (two on one file each answer from their own"
                         " cached state)") from None
    except OSError as exc:
        raise InputError(str(db), None, f"cannot open the database to claim it ({exc.strerror})"
                         ) from None
    if held is None:   # a file system without flock (some FUSE, old NFS): no claim
        log.warning("%s: cannot lock the database file: a second service on it would not be"
                    " refused", db)
    return Claim(held)
