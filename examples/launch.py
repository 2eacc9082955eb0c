"""What the distributed examples share: the torchrun check and how a worker reports an error.

Outside torchrun, `init_process_group` fails deep inside torch ("environment variable RANK
expected"); the examples say instead how to launch them. Under torchrun every worker runs the
same checks, so a refused flag would be printed once per rank (each with a traceback):
`main_once` prints it once, as one line from rank 0.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def require_torchrun(nproc: int = 2) -> None:
    """Exit 2 with the command to use when this process was not started by torchrun."""
    missing = [v for v in TORCHRUN_VARIABLES if v not in os.environ]
    if not missing:
        return
    script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "this script"
    print(f"error: {script} runs under torchrun (the environment lacks {', '.join(missing)}); "
          f"e.g. python -m torch.distributed.run --nproc-per-node {nproc} {script} "
          f"{' '.join(sys.argv[1:])}".rstrip(), file=sys.stderr)
    raise SystemExit(2)


def exit_without_finalizing(code: int = 0) -> None:
    """End a finished distributed script at once: stdio flushed, no interpreter shutdown.

    torch 2.13 keeps DDP's and FSDP2's world-group gloo threads alive after
    destroy_process_group(); one that frees a Python callback while the interpreter shuts
    down is killed mid-C++ frame and the process aborts ("terminate called without an active
    exception", SIGABRT), rarely, after all the work is done. Call this last, once the
    recorder is closed, files are written and the group is destroyed: nothing is left to lose.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main_once(main: Callable[[], object]) -> int:
    """Run a worker's main; a refusal (SystemExit with a message, or a stragglers error) is one
    line and exit 2 (3 for an environment failure). Before the process group exists every rank
    runs the same checks, so only rank 0 prints it; after, the rank that failed prints it."""
    from stragglers.errors import StragglersError

    try:
        code = main()
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        return refused(exc.code, 2)
    except StragglersError as exc:
        return refused(str(exc), exc.exit_code)
    return code if isinstance(code, int) else 0


def refused(message: str, code: int, wait_s: float = 60.0) -> int:
    """Print `message` as one error line, once for the job when no group exists yet.

    Before the group: rank 0 prints; the other ranks, which hit the same refusal, wait (at most
    wait_s) so that rank 0 has printed before torchrun, seeing a rank exit, stops the group (it
    ends them when rank 0 exits). After: this rank's own failure, printed by it at once.
    """
    text = message if message.startswith("error:") else f"error: {message}"
    rank = os.environ.get("RANK", "0")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        print(f"error: rank {rank}: {text.removeprefix('error: ')}", file=sys.stderr, flush=True)
    elif rank == "0":
        print(text, file=sys.stderr, flush=True)
    else:
        time.sleep(wait_s)
    return code


def refuse_earlier_run(directory, overwrite: bool, flag: str = "--trace-dir") -> None:
    """Exit with one line naming --overwrite when `directory` already holds files (a finished
    run): checked before any process group exists, so no rank waits on another."""
    from pathlib import Path

    if os.environ.get("STRAGGLERS_RECORD_DIR") or \
            os.environ.get("STRAGGLERS_RECORD", "").strip().lower() in ("0", "off", "false", "no"):
        return  # `stragglers record --out DIR` chose (and checked) the directory, or it is off
    d = Path(directory)
    found = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
    if found and not overwrite:
        shown = ", ".join(found[:3]) + (", …" if len(found) > 3 else "")
        raise SystemExit(f"{flag} {d} holds an earlier run ({shown}); pass --overwrite to "
                         f"replace it, or choose another {flag}")
