"""Coded data-parallel training on torch.distributed: rank 0 aggregates, ranks 1..n compute.

Protocol (one process group, world size n + 1; see README.md):
  master → worker w: header int64 [step, command] (tag 1), then the flat parameters (tag 2);
                     sent only to an idle worker, so a straggler always restarts on fresh state.
  worker w → master: [step, f_w (coded gradient), coded loss] (tag GRAD_TAG + step), with
                     f_w = Σ_j B_wj g_j over its parts j (complex codes: real/imag interleaved),
                     in `message_dtype` (float32 by default), on the model's device.
The master waits for the first n − s messages of the current step, decodes in float64 and steps
the optimizer. A message of an older step is late: it is dropped (its step id never matches the
current step, and its irecv has its own tag and buffer), and the worker gets the current step.
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from stragglers.coding.data import PartitionedData
from stragglers.coding.matrix_code import MatrixCode
from stragglers.coding.stability import DEFAULT_TOLERANCE, check_stability, decode_error_bound
from stragglers.errors import InputError, StragglersError

MASTER = 0
HEADER_TAG, PARAMS_TAG, GRAD_TAG = 1, 2, 1000
WORK, STOP = 0, 1
MESSAGE_DTYPES = {torch.float32: "float32", torch.float64: "float64"}


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work before reading a host clock (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class CodedStep:
    """What the aggregator saw at one step."""

    step: int
    seconds: float  # since the start of training, evaluation time excluded
    survivors: list[int]
    late_dropped: int
    decode_seconds: float
    loss: float  # decoded mean mini-batch loss of the n parts
    condition: float | None = None
    eval_loss: float | None = None
    error: float | None = None  # ‖ĝ − g‖₂ (check_error=True)
    error_bound: float | None = None  # ‖aᵀB − 1ᵀ‖₂·‖G‖_F, the per-step bound on error
    grad_norm: float | None = None  # ‖G‖_F of the n part gradients
    numerical_bound: float | None = None  # ρ(K) of this decode: rounding error <= ρ·‖G‖_F


@dataclass
class TrainResult:
    """The aggregator's history of one training run."""

    code: str
    n: int
    s: int
    records: list[CodedStep] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)  # after each step (keep_params)
    late_total: int = 0
    drained: int = 0  # late messages collected at shutdown (also unused)
    reached_target: bool = False

    @property
    def seconds(self) -> float:
        """Training time (evaluation excluded)."""
        return self.records[-1].seconds if self.records else 0.0

    def time_to_loss(self, target: float) -> float | None:
        """First training time at which the evaluated loss is <= target (None if never)."""
        for r in self.records:
            if r.eval_loss is not None and r.eval_loss <= target:
                return r.seconds
        return None


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


def combine_messages(decoding, messages: list[torch.Tensor]) -> torch.Tensor:
    """Σ_k a_k f_k in float64 on the messages' device (complex codes: interleaved real/imag
    parts in, the real part out); `messages` in the order of `decoding.survivors`."""
    if len(messages) != len(decoding.survivors):
        raise InputError(decoding.code.name, "messages", f"expected one message per survivor "
                                                         f"({len(decoding.survivors)}), got "
                                                         f"{len(messages)}")
    device = messages[0].device
    a = torch.as_tensor(decoding.coefficients[list(decoding.survivors)], device=device)
    M = torch.stack(messages).double()
    if decoding.code.is_complex:
        M = torch.view_as_complex(M.reshape(len(messages), -1, 2))
    combined = a.to(M.dtype) @ M
    return combined.real if combined.is_complex() else combined


def part_gradient(model: torch.nn.Module, loss_fn: Callable, data: PartitionedData, part: int,
                  step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat gradient and the loss of part `part`'s mini-batch at `step`."""
    device = next(model.parameters()).device
    x, y = data.batch(part, step)
    model.zero_grad(set_to_none=False)
    loss = loss_fn(model(x.to(device)), y.to(device))
    loss.backward()
    return _flat_grad(model).detach().clone(), loss.detach()


def train_coded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                data: PartitionedData, code: MatrixCode, steps: int, *,
                delays: Callable[[int, int], float] | None = None,
                evaluate: Callable[[torch.nn.Module], float] | None = None, eval_every: int = 10,
                target_loss: float | None = None, keep_params: bool = False,
                check_error: bool = False, record_condition: bool = False,
                timeout: float = 300.0, message_dtype: torch.dtype = torch.float32,
                tolerance: float = DEFAULT_TOLERANCE, on_unstable: str = "raise"
                ) -> TrainResult | None:
    """Train `model` with gradient code `code`; every rank calls this. Rank 0 returns the history.

    World size must be n + 1. The update gradient is (1/n)·Σ_j ∇L_j, the mean of the n parts'
    mini-batch losses (exactly for exact codes, within ‖aᵀB − 1ᵀ‖·‖G‖_F/n for approximate ones).
    The stability guard is re-run here for the messages actually sent (`message_dtype`), on
    every rank, so an unstable code is refused everywhere before any message is sent.
    """
    if not dist.is_initialized():
        raise StragglersError("train_coded needs torch.distributed initialised (use torchrun)")
    if dist.get_world_size() != code.n + 1:
        raise InputError("train_coded", "world_size", f"expected n + 1 = {code.n + 1} ranks "
                                                      f"(1 master + n workers), got "
                                                      f"{dist.get_world_size()}")
    if data.n != code.n:
        raise InputError("train_coded", "data", f"expected {code.n} parts, got {data.n}")
    if not 0 <= steps < 2 ** 24:  # the step id travels as a float32 in each message
        raise InputError("train_coded", "steps", f"expected 0 <= steps < 2**24, got {steps}")
    if message_dtype not in MESSAGE_DTYPES:
        raise InputError("train_coded", "message_dtype", f"expected torch.float32 or "
                                                         f"torch.float64, got {message_dtype}")
    check_stability(code, MESSAGE_DTYPES[message_dtype], tolerance, on_unstable)
    dist.barrier()
    if dist.get_rank() == MASTER:
        return _Aggregator(model, optimizer, loss_fn, data, code, delays, timeout,
                           message_dtype).run(
            steps, evaluate, eval_every, target_loss, keep_params, check_error, record_condition)
    _work(model, loss_fn, data, code, dist.get_rank() - 1, delays, message_dtype)
    return None


def _work(model, loss_fn, data, code, worker, delays, real) -> None:
    """Worker loop: receive (step, params), compute the coded gradient, sleep the delay, send."""
    device = next(model.parameters()).device
    header = torch.zeros(2, dtype=torch.int64, device=device)
    params = parameters_to_vector(model.parameters()).detach().clone()
    parts, weights = code.parts(worker), code.weights(worker)
    cdtype = {torch.float32: torch.complex64, torch.float64: torch.complex128}[real] \
        if code.is_complex else real
    w = torch.as_tensor(weights, dtype=cdtype, device=device)
    while True:
        dist.recv(header, src=MASTER, tag=HEADER_TAG)
        step, command = int(header[0]), int(header[1])
        if command == STOP:
            return
        dist.recv(params, src=MASTER, tag=PARAMS_TAG)
        with torch.no_grad():
            vector_to_parameters(params, model.parameters())
        coded: torch.Tensor | None = None
        for k, j in enumerate(parts):
            g, loss = part_gradient(model, loss_fn, data, j, step)
            payload = torch.cat([g, loss.reshape(1)]).to(cdtype)
            coded = w[k] * payload if coded is None else coded + w[k] * payload
        assert coded is not None    # every worker of a code computes at least one part
        if code.is_complex:
            coded = torch.view_as_real(coded).reshape(-1)
        delay = delays(step, worker) if delays else 0.0
        if delay > 0:
            time.sleep(delay)
        msg = torch.cat([torch.tensor([float(step)], dtype=real, device=device), coded.to(real)])
        dist.send(msg, dst=MASTER, tag=GRAD_TAG + step)


class _Aggregator:
    """The master: hands out steps, collects the first n − s arrivals, decodes, updates."""

    def __init__(self, model, optimizer, loss_fn, data, code, delays, timeout, message_dtype):
        self.message_dtype = message_dtype
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.data, self.code, self.timeout = data, code, timeout
        self.device = next(model.parameters()).device
        self.n_params = sum(p.numel() for p in model.parameters())
        width = (self.n_params + 1) * (2 if code.is_complex else 1)
        self.msg_len = 1 + width
        self.arrivals: queue.Queue = queue.Queue()
        self.pool = ThreadPoolExecutor(max_workers=code.n, thread_name_prefix="coded-recv")
        self.sends: dict[int, list] = {w: [] for w in range(code.n)}
        self.busy: dict[int, int] = {}  # worker -> the step it is computing
        self.poll = dist.get_backend() == "nccl"

    def _assign(self, worker: int, step: int, params: torch.Tensor | None,
                command: int = WORK) -> None:
        for work in self.sends[worker]:  # the worker is idle, so it has received these
            work.wait()
        header = torch.tensor([step, command], dtype=torch.int64, device=self.device)
        rank = worker + 1
        self.sends[worker] = [dist.isend(header, dst=rank, tag=HEADER_TAG)]
        if command == STOP:
            return
        assert params is not None   # only STOP is sent without parameters
        self.sends[worker].append(dist.isend(params, dst=rank, tag=PARAMS_TAG))
        buf = torch.empty(self.msg_len, dtype=self.message_dtype, device=self.device)
        recv = dist.irecv(buf, src=rank, tag=GRAD_TAG + step)
        self.busy[worker] = step
        self.pool.submit(self._await, recv, worker, step, buf)

    def _await(self, recv, worker: int, step: int, buf: torch.Tensor) -> None:
        try:
            if self.poll:  # NCCL: wait() only orders streams; completion must be polled
                while not recv.is_completed():
                    time.sleep(1e-4)
            else:
                recv.wait()
            self.arrivals.put((worker, step, buf))
        except Exception as exc:  # surfaced in the main thread
            self.arrivals.put((worker, step, exc))

    def _next_arrival(self):
        try:
            worker, step, buf = self.arrivals.get(timeout=self.timeout)
        except queue.Empty:
            raise StragglersError(f"no worker message for {self.timeout:.0f}s; busy workers: "
                                  f"{sorted(self.busy)}") from None
        if isinstance(buf, Exception):
            raise StragglersError(f"receiving from worker {worker} failed: {buf}") from buf
        if int(buf[0]) != step:
            raise StragglersError(f"worker {worker} sent step {int(buf[0])} under the tag of "
                                  f"step {step}")
        del self.busy[worker]
        return worker, step, buf

    def run(self, steps, evaluate, eval_every, target_loss, keep_params, check_error,
            record_condition) -> TrainResult:
        code, n = self.code, self.code.n
        result = TrainResult(code.name, n, code.s)
        idle = list(range(n))
        eval_time = 0.0
        start = time.perf_counter()
        ok = False
        try:
            for step in range(steps):
                params = parameters_to_vector(self.model.parameters()).detach().clone()
                for w in idle:
                    self._assign(w, step, params)
                got: list[tuple[int, torch.Tensor]] = []
                late = 0
                while len(got) < code.needed:
                    worker, sent_step, buf = self._next_arrival()
                    if sent_step == step:
                        got.append((worker, buf))
                    else:  # late: drop it, put the worker on the current step
                        late += 1
                        self._assign(worker, step, params)
                idle = [w for w, _ in got]
                rec = self._update(step, got, late, check_error, record_condition)
                _sync(self.device)
                rec.seconds = time.perf_counter() - start - eval_time
                result.late_total += late
                if keep_params:
                    result.params.append(
                        parameters_to_vector(self.model.parameters()).detach().clone())
                if evaluate is not None and ((step + 1) % eval_every == 0 or step == steps - 1):
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        rec.eval_loss = float(evaluate(self.model))
                    eval_time += time.perf_counter() - t0
                result.records.append(rec)
                if target_loss is not None and rec.eval_loss is not None \
                        and rec.eval_loss <= target_loss:
                    result.reached_target = True
                    break
            ok = True
        finally:
            result.drained = self._shutdown(drain=ok)
        return result

    def _update(self, step, got, late, check_error, record_condition) -> CodedStep:
        code, n, P = self.code, self.code.n, self.n_params
        t0 = time.perf_counter()
        survivors = [w for w, _ in got]
        decoding = code.decode(survivors)
        combined = combine_messages(decoding, [buf[1:] for _, buf in got])
        _sync(self.device)
        decode_s = time.perf_counter() - t0
        grad, loss = combined[:P] / n, float(combined[P]) / n
        rec = CodedStep(step, 0.0, survivors, late, decode_s, loss)
        rec.numerical_bound = decode_error_bound(decoding, MESSAGE_DTYPES[self.message_dtype])
        if record_condition:
            rec.condition = decoding.condition_number
        if check_error:
            G = torch.stack([part_gradient(self.model, self.loss_fn, self.data, j, step)[0]
                             for j in range(n)]).double()
            rec.error = float(torch.linalg.norm(combined[:P] - G.sum(0)))
            rec.grad_norm = float(torch.linalg.norm(G))
            rec.error_bound = decoding.residual * rec.grad_norm
        offset = 0
        for p in self.model.parameters():
            k = p.numel()
            p.grad = grad[offset:offset + k].reshape(p.shape).to(p.dtype).clone()
            offset += k
        self.optimizer.step()
        return rec

    def _shutdown(self, drain: bool = True) -> int:
        # collect every outstanding (late) message so nothing leaks into a later run, then stop
        if not drain:
            self.pool.shutdown(wait=False, cancel_futures=True)
            return 0
        drained = len(self.busy)
        while self.busy:
            self._next_arrival()
        for w in range(self.code.n):
            self._assign(w, 0, None, STOP)
        for works in self.sends.values():
            for work in works:
                work.wait()
        self.pool.shutdown(wait=True)
        return drained


def set_seed(seed: int) -> None:
    """Seed torch and numpy so every rank builds the same model."""
    torch.manual_seed(seed)
    np.random.seed(seed)
