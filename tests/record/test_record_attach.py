"""attach() in one process: what a plain loop records, closures, evaluation, bad use, the switch."""

from __future__ import annotations

import gc
import os
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from stragglers.errors import InputError
from stragglers.record import attach
from stragglers.trace.model import OPTYPE_CODES
from stragglers.trace.runformat import read_run

FWD, BWD, OPT = (OPTYPE_CODES[n] for n in ("forward-compute", "backward-compute", "optimizer"))
GC = OPTYPE_CODES["gc"]


@pytest.fixture(autouse=True, params=["native", "python"])
def hooks(request, monkeypatch):
    """Every test with attach's native hooks and with its Python hooks (test_record_native.py
    checks that the native ones are built where they can be)."""
    from stragglers.record import native

    if request.param == "native" and native.load() is None:
        pytest.skip(f"native hooks not built: {native.last_error()}")
    monkeypatch.setenv(native.ENV, "1" if request.param == "native" else "0")
    return request.param


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def data(step: int, mb: int):
    g = torch.Generator().manual_seed(step * 10 + mb)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def train(model, opt, steps: int = 4, microbatches: int = 3, evaluate: bool = False) -> None:
    """A user's loop, untouched by the recorder."""
    for step in range(steps):
        for mb in range(microbatches):
            x, y = data(step, mb)
            (F.mse_loss(model(x), y) / microbatches).backward()
        opt.step()
        opt.zero_grad()
        if evaluate:  # evaluation forwards are not microbatches
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()


def rows(ops, step: int) -> list[tuple[int, int]]:
    sel = np.flatnonzero((ops["step"] == step) & (ops["optype"] != GC))
    sel = sel[np.argsort(ops["start_ts"][sel], kind="stable")]
    return [(int(ops["optype"][i]), int(ops["mb_id"][i])) for i in sel]


@pytest.mark.slow
def test_a_plain_loop_records_microbatches_and_the_optimizer(tmp_path):
    model, opt = make()
    with attach(model, opt, tmp_path / "run", flush_interval_s=0.01,
                seq_lens=lambda x: [5, 3]) as att:
        train(model, opt, evaluate=True)
    assert att.steps_seen == 4
    trace = read_run(tmp_path / "run")
    ops = trace.ops
    assert sorted(set(ops["step"].tolist())) == [0, 1, 2, 3]
    expect = [(FWD, 0), (BWD, 0), (FWD, 1), (BWD, 1), (FWD, 2), (BWD, 2), (OPT, -1)]
    for step in range(4):
        assert rows(ops, step) == expect, step
    comp = np.isin(ops["optype"], (FWD, BWD))
    assert np.all(ops["attn_cost"][comp] == 34.0) and np.all(ops["tokens"][comp] == 8)
    assert np.all(ops["duration"] >= 0)
    assert trace.meta.extra["recorded_by"] == "attach" and trace.meta.extra["wrapper"] == "none"
    assert (trace.meta.dp_size, trace.meta.pp_size) == (1, 1)


@pytest.mark.slow
def test_recording_changes_no_parameter(tmp_path):
    ref, ref_opt = make()
    train(ref, ref_opt)
    model, opt = make()
    with attach(model, opt, tmp_path / "run", flush_interval_s=0.01):
        train(model, opt)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_an_optimizer_closure_puts_forward_and_backward_before_the_step(tmp_path):
    model, _ = make()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=1)
    x, y = data(0, 0)

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    with attach(model, opt, tmp_path / "run", flush_interval_s=0.01):
        for _ in range(3):
            opt.step(closure)  # the closure runs inside optimizer.step, as in Lightning
    ops = read_run(tmp_path / "run").ops
    for step in range(3):
        assert rows(ops, step) == [(FWD, 0), (BWD, 0), (OPT, -1)]
        sel = ops["step"] == step
        opt_row = np.flatnonzero(sel & (ops["optype"] == OPT))[0]
        bwd_row = np.flatnonzero(sel & (ops["optype"] == BWD))[0]
        # may start at the backward's very end: 1 ns for the float seconds' rounding
        assert ops["start_ts"][opt_row] >= ops["start_ts"][bwd_row] + ops["duration"][bwd_row] - 1e-9


def test_sampling_records_one_step_in_k(tmp_path):
    model, opt = make()
    with attach(model, opt, tmp_path / "run", sample_every=2, flush_interval_s=0.01):
        train(model, opt, steps=6, microbatches=1)
    assert sorted(set(read_run(tmp_path / "run").ops["step"].tolist())) == [0, 2, 4]


def test_attaching_twice_is_refused_and_close_allows_it_again(tmp_path):
    model, opt = make()
    att = attach(model, opt, tmp_path / "a", flush_interval_s=0.01)
    with pytest.raises(InputError, match="already has a recorder attached"):
        attach(model, opt, tmp_path / "b")
    att.close()
    attach(model, opt, tmp_path / "b").close()


def test_unknown_wrappers_and_bad_arguments_are_one_line_errors(tmp_path):
    model, opt = make()
    with pytest.raises(InputError, match="DataParallel") as err:
        attach(nn.DataParallel(model), opt, tmp_path / "a")
    assert "\n" not in str(err.value)
    with pytest.raises(InputError, match="optimizer"):
        attach(model, "sgd", tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_the_environment_switch_turns_recording_off_or_redirects_it(tmp_path, monkeypatch):
    model, opt = make()
    monkeypatch.setenv("STRAGGLERS_RECORD", "0")
    with attach(model, opt, tmp_path / "off"):
        train(model, opt, steps=2, microbatches=1)
    assert not (tmp_path / "off").exists()
    monkeypatch.setenv("STRAGGLERS_RECORD", "1")
    monkeypatch.setenv("STRAGGLERS_RECORD_DIR", str(tmp_path / "redirected"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plain one-process loop needs no warning
        with attach(model, opt, tmp_path / "ignored", flush_interval_s=0.01):
            train(model, opt, steps=2, microbatches=1)
    assert not (tmp_path / "ignored").exists()
    assert len(read_run(tmp_path / "redirected").ops["step"]) > 0


@pytest.mark.parametrize("value", ["two", "0", "1.5"])
def test_a_bad_sampling_switch_is_one_line_naming_it(tmp_path, monkeypatch, value):
    # "two" was a ValueError traceback from int(); "0" reached the recorder's own check
    model, opt = make()
    monkeypatch.setenv("STRAGGLERS_RECORD_SAMPLE_EVERY", value)
    with pytest.raises(InputError) as err:
        attach(model, opt, tmp_path / "run")
    assert "\n" not in str(err.value)
    assert "STRAGGLERS_RECORD_SAMPLE_EVERY" in str(err.value) or err.value.field == "sample_every"


def test_activation_checkpoint_recomputation_is_not_a_microbatch(tmp_path):
    from torch.utils.checkpoint import checkpoint

    model, opt = make()
    with attach(model, opt, tmp_path / "run", flush_interval_s=0.01):
        for step in range(2):
            for mb in range(2):
                x, y = data(step, mb)
                # the whole model checkpointed: its forward runs again inside the backward
                F.mse_loss(checkpoint(model, x, use_reentrant=False), y).backward()
            opt.step()
            opt.zero_grad()
    ops = read_run(tmp_path / "run").ops
    assert rows(ops, 1) == [(FWD, 0), (BWD, 0), (FWD, 1), (BWD, 1), (OPT, -1)]


def test_a_pipelining_stage_module_is_refused(tmp_path):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    model, opt = make()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        stage = PipelineStage(model, stage_index=0, num_stages=1, device=torch.device("cpu"))
        with pytest.raises(InputError, match="pipelining stage"):
            attach(model, opt, tmp_path / "run")
        del stage
    finally:
        dist.destroy_process_group()
    assert not (tmp_path / "run").exists()


def collect_cycles() -> None:
    """A real garbage collection of a few ms (cycles only the collector frees)."""
    garbage = [[] for _ in range(20000)]
    for a, b in zip(garbage, garbage[1:]):
        a.append(b)
        b.append(a)
    del garbage, a, b
    gc.collect()


class CollectsInForward(nn.Module):
    """A model whose forward holds a real garbage collection (a pause of ≥ 50 µs)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(16, 4)

    def forward(self, x):
        collect_cycles()
        return self.net(x)


@pytest.mark.slow
def test_a_gc_pause_inside_forward_moves_before_its_row(tmp_path):
    torch.manual_seed(0)
    model = CollectsInForward()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gc.disable()  # only the collections in forward pause
    try:
        with attach(model, opt, tmp_path / "run", flush_interval_s=0.01):
            train(model, opt, steps=2, microbatches=1)
    finally:
        gc.enable()
    ops = read_run(tmp_path / "run").ops
    for step in range(2):
        assert rows(ops, step) == [(FWD, 0), (BWD, 0), (OPT, -1)]
        sel = ops["step"] == step
        g = np.flatnonzero(sel & (ops["optype"] == GC))
        f = np.flatnonzero(sel & (ops["optype"] == FWD))[0]
        assert len(g) == 1 and ops["duration"][g[0]] >= 50e-6
        # the pause precedes the forward, which keeps only its own time
        assert ops["start_ts"][g[0]] + ops["duration"][g[0]] <= ops["start_ts"][f] + 1e-9


@pytest.mark.slow
def test_a_gc_pause_between_steps_is_no_row(tmp_path):
    # (the native hooks begin a step as the previous one ends; a pause while the next batch
    # is loaded is still no part of either step, as with the Python hooks)
    model, opt = make()
    gc.disable()
    try:
        with attach(model, opt, tmp_path / "run", flush_interval_s=0.01):
            for step in range(3):
                collect_cycles()            # "data loading"
                for mb in range(2):
                    x, y = data(step, mb)
                    (F.mse_loss(model(x), y) / 2).backward()
                opt.step()
                opt.zero_grad()
    finally:
        gc.enable()
    ops = read_run(tmp_path / "run").ops
    assert not (ops["optype"] == GC).any()
    for step in range(3):
        assert rows(ops, step) == [(FWD, 0), (BWD, 0), (FWD, 1), (BWD, 1), (OPT, -1)]


class FailsInBackward(torch.autograd.Function):
    """Identity whose backward raises (a NaN check, an OOM): the pass ends without its end."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed")


def test_a_step_after_a_failed_backward_is_recorded_whole(tmp_path):
    model, opt = make()
    with attach(model, opt, tmp_path / "run", flush_interval_s=0.01):
        train(model, opt, steps=1, microbatches=2)
        x, y = data(1, 0)
        # fails below the model: its backward span has started and never ends
        x = FailsInBackward.apply(x.requires_grad_())
        with pytest.raises(RuntimeError, match="backward failed"):
            F.mse_loss(model(x), y).backward()
        opt.zero_grad()
        opt.step()  # the user skips the update; the step ends here
        train(model, opt, steps=2, microbatches=2)
    ops = read_run(tmp_path / "run").ops
    expect = [(FWD, 0), (BWD, 0), (FWD, 1), (BWD, 1), (OPT, -1)]
    assert rows(ops, 0) == expect and rows(ops, 2) == expect and rows(ops, 3) == expect
    assert rows(ops, 1) == [(FWD, 0), (OPT, -1)]  # no backward row: its end is unknown


def test_a_recorded_model_copies_and_saves_as_its_own_class_unrecorded(tmp_path, hooks):
    if hooks == "python":
        pytest.skip("Python hooks sit in the module's hook dicts: copy its state_dict instead")
    import copy
    import io

    model, opt = make()
    with attach(model, opt, tmp_path / "run", flush_interval_s=0.01):
        train(model, opt, steps=1, microbatches=1)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        ema = copy.deepcopy(model)  # as an EMA of the weights is made, mid-training
        buf = io.BytesIO()
        torch.save(model, buf)
        ema(data(9, 9)[0]).sum().backward()  # a training-mode forward of the copy: not recorded
        train(model, opt, steps=1, microbatches=1)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for m in (ema, loaded):
        assert type(m) is nn.Sequential and "_stragglers_call" not in m.__dict__
        assert all(torch.equal(v, weights[k]) for k, v in m.state_dict().items())
    ops = read_run(tmp_path / "run").ops
    assert rows(ops, 1) == [(FWD, 0), (BWD, 0), (OPT, -1)]


def test_attach_is_the_function_whatever_was_imported_first(hooks):
    # the implementation is the private stragglers.record._attach: no module shadows the name
    import importlib
    import types

    import stragglers
    import stragglers.record
    import stragglers.record._attach as impl

    assert isinstance(stragglers.record.attach, types.FunctionType)
    assert stragglers.record.attach is impl.attach is stragglers.attach
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("stragglers.record.attach")


REFUSED_SCRIPT = """
import torch
from stragglers.errors import InputError
from stragglers.record import attach
model = torch.nn.Linear(2, 2)
try:
    attach(model, "sgd", {out!r})
except InputError:
    print("caught", flush=True)
attach(model, "sgd", {out!r})
"""


def test_an_uncaught_refusal_in_a_users_script_is_one_line_not_a_traceback(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "user_script.py"
    script.write_text(REFUSED_SCRIPT.format(out=str(tmp_path / "run")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "RANK": "1"})
    # the refusal the script caught printed nothing of ours; the uncaught one is one line
    assert done.stdout == "caught\n"
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == ["error: rank 1: attach: field 'optimizer': expected a "
                     "torch.optim.Optimizer, got str"], done.stderr
