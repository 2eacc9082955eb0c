"""StragglAR phase-2 schedules: rounds against the lower bound n − 2 + ⌈log₂ n⌉, and generation time.

    .venv/bin/python benchmarks/stragglar_schedule.py [--even-up-to 64] [--time 256 1024]

Every even n from 4 up to --even-up-to is synthesised and verified (`synthesize`, as
`stragglers collectives schedule --n N` does); the rounds above the lower bound are listed.
For the sizes in --time the process CPU time of a fresh synthesis plus its verification is
printed. Goals (issue 4): n = 256 in ≤ 1 s; powers of two optimal.
"""

from __future__ import annotations

import argparse
import time

from results import Figure, Run, write

from stragglers.collectives.schedule import lower_bound_rounds, synthesize, verify


def timed(n: int) -> float:
    """Process CPU seconds to synthesise and verify the schedule for n ranks, uncached."""
    synthesize.cache_clear()
    t0 = time.process_time()
    verify(synthesize(n))
    return time.process_time() - t0


def main() -> None:
    """Print the rounds over the bound per even n and the generation times; write the result."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--even-up-to", type=int, default=64)
    ap.add_argument("--time", type=int, nargs="*", default=[256, 1024])
    args = ap.parse_args()
    excess: dict[int, int] = {}
    for n in range(4, args.even_up_to + 1, 2):
        excess[n] = synthesize(n).num_rounds - lower_bound_rounds(n)
        print(f"n={n}: {synthesize(n).num_rounds} rounds, lower bound {lower_bound_rounds(n)}",
              flush=True)
    at_bound = [n for n, e in excess.items() if e == 0]
    over = {e: [n for n, x in excess.items() if x == e] for e in sorted(set(excess.values())) if e}
    powers = [n for n in excess if n & (n - 1) == 0]
    times = {n: timed(n) for n in args.time}
    for n, s in times.items():
        print(f"n={n}: generated and verified in {s:.2f} s CPU", flush=True)
    figures = [Figure(name=f"even n ≤ {args.even_up_to} at the lower bound",
                      value=f"{len(at_bound)} of {len(excess)}: {', '.join(map(str, at_bound))}",
                      note="; ".join(f"+{e} at {', '.join(map(str, ns))}" for e, ns in over.items())),
               Figure(name="powers of two at the lower bound",
                      value=f"{sum(excess[n] == 0 for n in powers)} of {len(powers)}",
                      goal="optimal", met=all(excess[n] == 0 for n in powers))]
    figures += [Figure(name=f"n = {n}: synthesis + verification, CPU", value=f"{s:.2f} s",
                       goal="≤ 1 s" if n == 256 else "", met=(s <= 1.0) if n == 256 else None)
                for n, s in times.items()]
    write(Run(benchmark="StragglAR schedules: rounds and generation time", issue="4, 13",
              command=".venv/bin/python benchmarks/stragglar_schedule.py"
              + (f" --even-up-to {args.even_up_to}" if args.even_up_to != 64 else "")
              + (f" --time {' '.join(map(str, args.time))}" if args.time != [256, 1024] else ""),
              figures=figures))


if __name__ == "__main__":
    main()
