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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default=None, help="write the result as this name (a path: "
                        "there, e.g. /tmp/x) instead of results/whatif_noise_only.json")
    args = parser.parse_args()
    wrong = total = 0
    for dp, pp, mb, vpp in SHAPES:
        for noise in (0.02, 0.1, 0.2):
            for seed in (0, 1):
                total += 1
                r = analyze(generate(dp=dp, pp=pp, microbatches=mb, vpp=vpp, steps=6, seed=seed,
                                     noise=noise, sync="ddp" if pp == 1 else "zero"))
                causes = [d.cause for d in r.diagnosis]
                if causes != ["none"]:
                    wrong += 1
                    print(f"dp {dp} pp {pp} mb {mb} vpp {vpp} noise {noise} seed {seed}: S = "
                          f"{r['slowdown']:.3f}, floor {r['diagnosis_summary']['noise_floor']:.3f},"
                          f" diagnosed {causes}")
    print(f"noise-only jobs diagnosed none: {total - wrong} of {total}")
    write(Run(benchmark="Noise-only jobs diagnosed none", issue="10",
              command=".venv/bin/python benchmarks/whatif_noise_only.py",
              figures=[Figure(name="noise-only synthetic jobs diagnosed `none` (dp 1–128, pp 1–8, "
                                   "microbatches 1–8, vpp 1–2, noise σ 0.02 / 0.1 / 0.2, 2 seeds)",
                              value=f"{total - wrong} of {total}", goal="all `none`",
                              met=wrong == 0)]), args.name)


if __name__ == "__main__":
    main()
