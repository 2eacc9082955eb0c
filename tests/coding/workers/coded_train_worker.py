"""Run several codes in one process group on the digits data; rank 0 writes the histories as JSON."""

import argparse
import json
import warnings

import torch
import torch.distributed as dist

from stragglers.coding import make_code
from stragglers.coding.data import load_digits_parts
from stragglers.coding.delays import DelaySampler, FixedDelays
from stragglers.coding.training import set_seed, train_coded

SCHEMES = [  # (scheme, s, extra)
    ("wait-for-all", 0, {}),
    ("cyclic-mds-real", 1, {}),
    ("cyclic-mds-complex", 2, {}),
    ("frc", 1, {}),
    ("cyclic-repetition", 1, {}),
    ("expander", 1, {"d": 2, "decoder": "fixed"}),
    ("expander", 2, {"d": 2, "decoder": "optimal"}),
    ("ignore-stragglers", 1, {}),
]


def main() -> None:
    """Train every scheme for the same steps under the same delays."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    n = dist.get_world_size() - 1
    data = load_digits_parts(n, batch_size=16, seed=0)
    random = DelaySampler("pareto", 0.01, seed=3)
    # worker 0 is very slow at step 0: its message arrives while the master is steps ahead
    fixed = FixedDelays({(0, 0): 0.12})
    # every step takes >= 20 ms, so 10 steps outlast worker 0's 0.12 s and its message is late
    delays = lambda step, w: 0.02 + fixed(step, w) + random(step, w)  # noqa: E731
    X, y = data.all()
    out = {}
    for scheme, s, extra in SCHEMES:
        set_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        loss_fn = torch.nn.functional.cross_entropy
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            code = make_code(scheme, n, s, seed=1, **extra)
        res = train_coded(model, opt, loss_fn, data, code, args.steps, delays=delays,
                          evaluate=lambda m: float(loss_fn(m(X), y)), eval_every=2,
                          keep_params=True, check_error=True, record_condition=True)
        if res is not None:
            out[f"{scheme}/s={s}/{extra.get('decoder', '')}"] = {
                "code": res.code, "late_total": res.late_total, "drained": res.drained,
                "params": [p.tolist() for p in res.params],
                "survivors": [r.survivors for r in res.records],
                "errors": [r.error for r in res.records],
                "bounds": [r.error_bound for r in res.records],
                "grad_norms": [r.grad_norm for r in res.records],
                "conditions": [r.condition for r in res.records],
                "losses": [r.loss for r in res.records],
                "eval": [r.eval_loss for r in res.records],
                "late": [r.late_dropped for r in res.records],
            }
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
