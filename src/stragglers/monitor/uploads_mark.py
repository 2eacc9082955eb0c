"""Which store an uploads folder belongs to: a mark file holding the store's id.

An uploaded job's parts are files in the uploads folder (`--data-dir`), found by the job's name
alone; the store keeps which were acknowledged. Started with another store's folder, a monitor
replaced that store's acknowledged part files with its own uploads (atomic renames over them),
and started with an empty folder where its own uploads are elsewhere, it acknowledged new parts
into jobs whose stored parts it could not read, and analysed nothing of them, saying only that
a file had "vanished". The mark, written at the store's first start with the folder, ties them:
a folder marked for another store, or an unmarked folder of a store holding uploaded parts that
the folder does not hold, is refused at the start in one line. The mark moves with the folder,
so a store and its uploads moved together (or named by another path) go on.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from stragglers.errors import InputError
from stragglers.smallfiles import read_small_file

log = logging.getLogger(__name__)

MARK_FILE = ".stragglers-store"


def check_uploads_folder(store, data_dir: Path) -> None:
    """InputError naming `--data-dir` unless `data_dir` is `store`'s uploads folder: marked
    with its id, or (a folder from before marks) unmarked and holding the folder of every
    uploaded job not finished (a finished job's parts are never read again: their folders may
    have been removed); an unmarked folder is marked then (where the disk lets it)."""
    ident = store.store_id()
    if ident is None:   # a full disk: nothing to compare with, nothing written
        return
    mark = data_dir / MARK_FILE
    held: str | None
    if not os.path.lexists(mark):
        held = None
    else:   # (a mark that cannot be read is no store's: one line naming it, as any other file)
        held = read_small_file(mark, "a store's id", 1024).decode("ascii", "replace").strip()
    if held == ident:
        return
    if held is not None:
        raise InputError(data_dir, None, "--data-dir: the uploads folder of another store "
                         f"({MARK_FILE} holds {held[:40]!r}, this store is {ident}); give each "
                         "store its own uploads folder (an upload to one replaced the other's "
                         "acknowledged parts)")
    missing = [job for job in store.uploaded_jobs() if not (data_dir / job).is_dir()]
    if missing:
        raise InputError(data_dir, None, f"--data-dir: not this store's uploads folder: it "
                         f"holds no folder of {len(missing)} uploaded job(s) whose parts the "
                         f"store acknowledged ({', '.join(missing[:3])}); start with the folder "
                         "they were uploaded to")
    try:
        tmp = mark.with_name(MARK_FILE + ".tmp")
        tmp.write_text(ident + "\n")
        os.replace(tmp, mark)
    except OSError as exc:   # (a full disk, a read-only folder: the check waits for a start)
        log.warning("the uploads folder %s could not be marked for its store (%s)", data_dir,
                    exc.strerror)
