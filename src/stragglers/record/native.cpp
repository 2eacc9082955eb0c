// Native recording hooks of stragglers.record.attach (CPU host clock; see native.py).
//
// The Python hooks attach used cost ~10-20 us of the training thread per recorded op, most of
// it torch's own dispatch of Python hooks. These stamp the same instants with no Python on the
// path: the backward pass's start (a pre-hook on the node that produced the model's output)
// and end (an autograd engine callback), and each DDP bucket's all-reduce (a C++ comm hook
// that does what DDP's default hook does: divide by the group size, all-reduce). Stamps go to
// an event log the Python side drains once per step and turns into rows.

#include <torch/extension.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <time.h>

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

namespace {

using Event = std::array<int64_t, 4>;  // (kind, id, time ns, bytes)
enum Kind : int64_t { BWD_START = 1, BWD_END = 2, BUCKET_READY = 3, BUCKET_DONE = 4 };

// CLOCK_MONOTONIC: the clock Python's time.perf_counter_ns reads on Linux (native.py checks).
int64_t now_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

struct Log {
  std::mutex mu;
  std::vector<Event> events;
  std::atomic<bool> in_backward{false};
  std::atomic<bool> on{true};

  void add(int64_t kind, int64_t id, int64_t t, int64_t bytes) {
    std::lock_guard<std::mutex> guard(mu);
    events.push_back({kind, id, t, bytes});
  }
};

// The first microbatch whose output the backward pass reaches opens the span; its end is the
// end of the whole pass (one backward over several microbatches' losses is one span).
void start_backward(const std::shared_ptr<Log>& log, int64_t mb) {
  bool expected = false;
  if (!log->on.load() || !log->in_backward.compare_exchange_strong(expected, true)) {
    return;
  }
  log->add(BWD_START, mb, now_ns(), 0);
  torch::autograd::Engine::get_default_engine().queue_callback([log]() {
    log->add(BWD_END, -1, now_ns(), 0);
    log->in_backward.store(false);
  });
}

struct BackwardStart : public torch::autograd::FunctionPreHook {
  BackwardStart(std::shared_ptr<Log> log, int64_t mb) : log_(std::move(log)), mb_(mb) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& grads) override {
    start_backward(log_, mb_);
    return grads;
  }
  std::shared_ptr<Log> log_;
  int64_t mb_;
};

// DDP's default hook (mean of the bucket over the group), with the bucket's ready and done
// instants stamped. The returned future completes after the done stamp, so DDP's end of
// backward, which waits on it, never sees a bucket whose row is still missing.
struct TimedAllReduce
    : public c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>> {
  TimedAllReduce(c10::intrusive_ptr<c10d::ProcessGroup> group, std::shared_ptr<Log> log)
      : CppCommHookInterface(std::move(group)), log_(std::move(log)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor& buffer = bucket.getBufferRef();
    const int64_t index = static_cast<int64_t>(bucket.getIndex());
    const bool on = log_->on.load();
    if (on) {
      log_->add(BUCKET_READY, index, now_ns(), buffer.numel() * buffer.element_size());
    }
    buffer.div_(state_->getSize());
    std::vector<at::Tensor> tensors = {buffer};
    auto fut = state_->allreduce(tensors)->getFuture();
    if (!on) {
      return fut;
    }
    auto log = log_;
    return fut->then(
        [log, index](c10::ivalue::Future& done) {
          log->add(BUCKET_DONE, index, now_ns(), 0);
          return done.value();
        },
        fut->elementType());
  }

  std::shared_ptr<Log> log_;
};

class Stamps {
 public:
  Stamps() : log_(std::make_shared<Log>()) {}

  // Hook the node that produced `output`; false when it has none (a leaf: use start()).
  bool mark_backward(const at::Tensor& output, int64_t mb) {
    const auto& fn = output.grad_fn();
    if (!fn) {
      return false;
    }
    fn->add_pre_hook(std::make_unique<BackwardStart>(log_, mb));
    return true;
  }

  void start(int64_t mb) { start_backward(log_, mb); }

  void register_ddp(py::object reducer, py::object group) {
    auto* r = reducer.cast<c10d::Reducer*>();
    auto* g = group.cast<c10d::ProcessGroup*>();
    auto owned = c10::intrusive_ptr<c10d::ProcessGroup>::unsafe_reclaim_from_nonowning(g);
    r->register_comm_hook(std::make_unique<TimedAllReduce>(owned, log_));
  }

  // The events so far as bytes (int64 rows of kind, id, ns, bytes): one object to hand to
  // the writer thread, which decodes them (stamp_rows); b"" when there are none.
  py::bytes drain() {
    std::vector<Event> out;
    {
      std::lock_guard<std::mutex> guard(log_->mu);
      out.swap(log_->events);
    }
    return py::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(Event));
  }

  // A backward that raised never ran its end callback: a new step starts outside backward.
  void reset() { log_->in_backward.store(false); }

  // Hooks already installed stay (DDP keeps its comm hook for life) but stamp nothing.
  void close() {
    log_->on.store(false);
    std::lock_guard<std::mutex> guard(log_->mu);
    log_->events.clear();
  }

 private:
  std::shared_ptr<Log> log_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "stragglers.record native hooks: backward and DDP bucket stamps without Python";
  m.def("now_ns", &now_ns, "The clock the stamps are on (CLOCK_MONOTONIC), in ns.");
  py::class_<Stamps>(m, "Stamps")
      .def(py::init<>())
      .def("mark_backward", &Stamps::mark_backward, py::arg("output"), py::arg("mb"))
      .def("start", &Stamps::start, py::arg("mb"))
      .def("register_ddp", &Stamps::register_ddp, py::arg("reducer"), py::arg("group"))
      .def("drain", &Stamps::drain)
      .def("reset", &Stamps::reset)
      .def("close", &Stamps::close);
}
