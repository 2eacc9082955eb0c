"""What the distributed examples check first: that torchrun started them (else one line and exit 2).

Outside torchrun, `init_process_group` fails deep inside torch ("environment variable RANK
expected"); the examples say instead how to launch them.
"""

from __future__ import annotations

import os
import sys

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
