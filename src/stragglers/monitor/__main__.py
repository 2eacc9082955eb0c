"""`python -m stragglers.monitor serve ...`: the monitor's commands without the full CLI."""

import sys

from stragglers.errors import StragglersError
from stragglers.monitor.commands import group

if __name__ == "__main__":
    try:
        group(standalone_mode=False)
    except StragglersError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
