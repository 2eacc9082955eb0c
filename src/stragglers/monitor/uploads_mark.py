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

import hashlib
import logging
import os
import re
import time
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


PROBE_DIR = ".stragglers-instances"
UNSHARED = " unshared"   # recorded after the probe name by an instance missing another's
PROBE_NAME = re.compile("[0-9a-f]{24}")
PROBE_KEEP_S = 86400.0   # a probe file not touched this long is a dead instance's: removed


class InstanceProbe:
    """Whether the instances sharing a store share its uploads folder: each writes a probe
    file into its `--data-dir` and records its name in the store (with its heartbeat); one
    that cannot see the probe of every other live instance in its own folder does not share
    theirs. Two PostgreSQL instances each given a folder of its own, both started before any
    part was stored, each marked its own folder with the one store id and ran: every upload
    was acknowledged and none analysed (a job's holder could not read the parts the other
    instance wrote). Checked at the start (refused) and at every heartbeat (uploads 503)."""

    def __init__(self, data_dir: Path, instance: str):
        self.folder = data_dir / PROBE_DIR
        # (a name of safe characters whatever the host name holds)
        self.name = hashlib.sha256(instance.encode("utf-8", "replace")).hexdigest()[:24]
        self.instance = instance

    def write(self) -> None:
        """Write (or touch) this instance's probe file; OSError where it cannot be."""
        self.folder.mkdir(exist_ok=True)
        path = self.folder / self.name
        try:
            os.utime(path)
        except FileNotFoundError:
            path.write_text(self.instance + "\n")

    def remove(self) -> None:
        """This instance's probe goes (a clean stop), and probes not touched for a day (the
        instances that wrote them were killed)."""
        try:
            (self.folder / self.name).unlink(missing_ok=True)
            old = time.time() - PROBE_KEEP_S
            for path in self.folder.iterdir():
                if path.is_file() and path.stat().st_mtime < old:
                    path.unlink(missing_ok=True)
        except OSError:
            pass   # (left: probes of instances that are not live are never looked at)

    def record(self, unshared: bool) -> str:
        """What the heartbeat records: the probe's name, and whether this instance found a
        live instance's probe missing from its folder (a folder that stopped being shared
        may still hold the others' probes from before: they must hear it from this one)."""
        return self.name + (UNSHARED if unshared else "")

    def problem(self, store, own: bool = False) -> str | None:
        """Why uploads cannot be taken into this folder (one line), or None: a live
        instance whose probe is missing here, or (not `own`) one that misses another's in
        its folder; the instances are named."""
        mine, theirs = self.problems(store)
        return mine if own else mine or theirs

    def problems(self, store) -> tuple[str | None, str | None]:
        """(a live instance's probe missing here, a live instance missing another's in its
        folder): each the one line that says so, or None."""
        missing, flagged = [], []
        for instance, recorded in store.live_probes(self.instance):
            name = recorded.removesuffix(UNSHARED)
            # (a name the store holds damaged is no probe's: never a path out of the folder)
            if not PROBE_NAME.fullmatch(name):
                continue
            if not os.path.lexists(self.folder / name):
                missing.append(instance)
            elif recorded != name:
                flagged.append(instance)
        start = "the uploads folder (--data-dir) is not the one the other instances of this " \
                "store write to: "
        end = "; give every instance one shared folder (a part acknowledged by one could " \
              "not be analysed by another)"
        return (None if not missing else
                f"{start}{len(missing)} live instance(s) ({_names(missing)}) wrote a probe "
                f"into theirs ({PROBE_DIR}/) that is not in this one{end}",
                None if not flagged else
                f"{start}{len(flagged)} live instance(s) ({_names(flagged)}) do not see "
                f"this one's probe ({PROBE_DIR}/) in theirs{end}")


def _names(instances: list[str]) -> str:
    return ", ".join(i[:60] for i in instances[:3])
