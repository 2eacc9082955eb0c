"""Noise-only synthetic jobs (no injected cause) over sizes, noise levels and seeds: every one
must be diagnosed `none`. Prints the ones that are not, with S and the noise floor.

    .venv/bin/python benchmarks/whatif_noise_only.py [--name /tmp/x]
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
FEW_STEPS = (5, 6)
FEW_SEEDS = range(20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default=None, help="write the result as this name (a path: "
                        "there, e.g. /tmp/x) instead of results/whatif_noise_only.json")
    args = parser.parse_args()
    jobs: list[tuple[tuple[int, int, int, int], int, float, int]] = [
        (shape, 6, noise, seed) for shape in SHAPES for noise in (0.02, 0.1, 0.2)
        for seed in (0, 1)]
    jobs += [(shape, steps, 0.2, seed) for shape in FEW_SHAPES for steps in FEW_STEPS
             for seed in FEW_SEEDS]
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
              command=".venv/bin/python benchmarks/whatif_noise_only.py",
              figures=[Figure(name="noise-only synthetic jobs diagnosed `none` (dp 1–128, pp 1–8, "
                                   "microbatches 1–8, vpp 1–2, noise σ 0.02 / 0.1 / 0.2, 2 seeds; "
                                   "and 2–4 workers a stage, dp 4 × pp 1 and dp 2 × pp 2, 5–6 "
                                   f"steps, σ 0.2, {len(FEW_SEEDS)} seeds)",
                              value=f"{total - wrong} of {total}", goal="all `none`",
                              met=wrong == 0)]), args.name)


if __name__ == "__main__":
    main()
