"""Noise-only synthetic jobs (no injected cause) over sizes, noise levels and seeds: every one
must be diagnosed `none`. Prints the ones that are not, with S and the noise floor.

    .venv/bin/python benchmarks/whatif_noise_only.py [--name /tmp/x]
        [--few-seeds 20] [--first-seed 0] [--few-noise 0.2] [--few-steps 5,6]

The few-worker jobs' options widen the sweep (more seeds, other steps or noise): the figure
written names them.
"""

import argparse

from results import Figure, Run, write

from stragglers.trace.synth import generate
from stragglers.whatif import analyze

SHAPES = [(128, 1, 1, 1), (128, 2, 2, 1), (64, 4, 4, 1), (16, 4, 4, 2), (2, 8, 8, 1), (1, 1, 4, 1),
          (64, 8, 8, 1)]  # (dp, pp, microbatches, vpp)
# 2-4 workers a stage over a few steps, where the sign tests of worker_fault and slow_group
# decide (no outlier test): (dp, pp, microbatches, vpp), steps, noise σ 0.2, these seeds
FEW_SHAPES = [(4, 1, 4, 1), (2, 2, 4, 1)]
FEW_STEPS = "5,6"
FEW_SEEDS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default=None, help="write the result as this name (a path: "
                        "there, e.g. /tmp/x) instead of results/whatif_noise_only.json")
    parser.add_argument("--few-seeds", type=int, default=FEW_SEEDS,
                        help="seeds of each few-worker shape, steps and noise")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="the few-worker jobs' first seed")
    parser.add_argument("--few-noise", default="0.2",
                        help="the few-worker jobs' noise σ (a list: 0.2,0.3)")
    parser.add_argument("--few-steps", default=FEW_STEPS,
                        help="the few-worker jobs' steps (a list: 5,6)")
    args = parser.parse_args()
    seeds = range(args.first_seed, args.first_seed + args.few_seeds)
    steps_list = [int(x) for x in args.few_steps.split(",")]
    noises = [float(x) for x in args.few_noise.split(",")]
    jobs: list[tuple[tuple[int, int, int, int], int, float, int]] = [
        (shape, 6, noise, seed) for shape in SHAPES for noise in (0.02, 0.1, 0.2)
        for seed in (0, 1)]
    jobs += [(shape, steps, noise, seed) for shape in FEW_SHAPES for steps in steps_list
             for noise in noises for seed in seeds]
    wrong = 0
    for (dp, pp, mb, vpp), steps, noise, seed in jobs:
        r = analyze(generate(dp=dp, pp=pp, microbatches=mb, vpp=vpp, steps=steps, seed=seed,
                             noise=noise, sync="ddp" if pp == 1 else "zero"))
        causes = [d.cause for d in r.diagnosis]
        if causes != ["none"]:
            wrong += 1
            floor = r.diagnosis_summary.noise_floor if r.diagnosis_summary else None
            print(f"dp {dp} pp {pp} mb {mb} vpp {vpp} steps {steps} noise {noise} seed {seed}: "
                  f"S = {r.slowdown:.3f}, floor {floor if floor is None else f'{floor:.3f}'},"
                  f" diagnosed {causes}")
    total = len(jobs)
    print(f"noise-only jobs diagnosed none: {total - wrong} of {total}")
    write(Run(benchmark="Noise-only jobs diagnosed none", issue="10",
              command=" ".join([".venv/bin/python benchmarks/whatif_noise_only.py"] + [
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                  if k != "name" and v != parser.get_default(k)]),
              figures=[Figure(name="noise-only synthetic jobs diagnosed `none` (dp 1–128, pp 1–8, "
                                   "microbatches 1–8, vpp 1–2, noise σ 0.02 / 0.1 / 0.2, 2 seeds; "
                                   "and 2–4 workers a stage, dp 4 × pp 1 and dp 2 × pp 2, "
                                   f"{_span(steps_list)} steps, σ {_span(noises)}, "
                                   f"{_seeds(seeds)})",
                              value=f"{total - wrong} of {total}", goal="all `none`",
                              met=wrong == 0)]), args.name)


def _span(values: list) -> str:
    """'5–6' for a run of integers, else the values joined ('0.2 / 0.3')."""
    if all(isinstance(v, int) for v in values) and values == list(range(values[0],
                                                                          values[-1] + 1)):
        return f"{values[0]}–{values[-1]}" if len(values) > 1 else str(values[0])
    return " / ".join(str(v) for v in values)


def _seeds(seeds: range) -> str:
    """'20 seeds' from seed 0, else '200 seeds from 1000'."""
    return f"{len(seeds)} seeds" + (f" from {seeds.start}" if seeds.start else "")


if __name__ == "__main__":
    main()
