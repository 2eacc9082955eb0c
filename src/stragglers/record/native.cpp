// Native recording hooks of stragglers.record.attach (CPU host clock; see native.py).
//
// The Python hooks attach used cost ~10-20 us of the training thread per recorded op, most of
// it torch's own dispatch of Python hooks. These stamp the same instants with no Python of
// ours on the path: each microbatch's forward (a wrapper of the module's call), the backward
// pass's start (a pre-hook on the node that produced the model's output) and end (an autograd
// engine callback), and each DDP bucket's all-reduce (a C++ comm hook that does what DDP's
// default hook does: divide by the group size, all-reduce). Stamps go to an event log the
// Python side drains once per step; the writer thread turns them into rows (native.py:
// stamp_columns, stamp_rows). A Waiter waits the Recorder's p2p transfers and stamps their
// completion on a C++ thread (recorder.py: _NativeCompletionWaiter).

#include <torch/extension.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

// (kind, id, time ns, value): value is a bucket's bytes (BUCKET_READY) or a forward's end ns
using Event = std::array<int64_t, 4>;
enum Kind : int64_t { BWD_START = 1, BWD_END = 2, BUCKET_READY = 3, BUCKET_DONE = 4, FWD = 5 };

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

  // The events so far as bytes (int64 rows of kind, id, ns, bytes): one object to hand to the
  // writer thread, which decodes them (stamp_rows); b"" when there are none.
  py::bytes drain() {
    std::vector<Event> out;
    {
      std::lock_guard<std::mutex> guard(mu);
      out.swap(events);
    }
    return py::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(Event));
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

// A module's calls, timed. The state of the step (open, mode, microbatch count) is set by the
// Python side: arm() at a step's first forward (Attached._begin), set_mode() in the optimizer's
// pre-hook, step_end() at its end, which arms the next step or disarms; the common
// case, a training forward in a sampled step with nothing else to read, runs here alone.
class Forward {
 public:
  enum Mode : int { SLOW = 0, FAST = 1, SKIP = 2 };

  Forward(std::shared_ptr<Log> log, py::object call, py::object begin, py::object slow,
          py::object leaves, py::object leaf_hook)
      : log_(std::move(log)), call_(std::move(call)), begin_(std::move(begin)),
        slow_(std::move(slow)), leaves_(std::move(leaves)), leaf_hook_(std::move(leaf_hook)) {}

  // module(*args, **kwargs) in CPython's vectorcall form (args[0] is the module, `dict` its
  // __dict__), recorded when it is a microbatch's forward; a new reference, or null with the
  // Python error set.
  PyObject* call(PyObject* const* args, size_t nargsf, PyObject* kwnames, PyObject* dict) {
    PyObject* fn = call_.ptr();
    if (released_) {
      return PyObject_Vectorcall(fn, args, nargsf, kwnames);
    }
    // nested, evaluation, or recomputation inside backward: not a microbatch
    if (depth_ > 0 || !at::GradMode::is_enabled() ||
        torch::autograd::get_current_graph_task_id() != -1 || !training(args[0], dict)) {
      Depth nested(depth_);
      return PyObject_Vectorcall(fn, args, nargsf, kwnames);
    }
    try {
      if (!open_) {
        begin_();  // Attached._begin: arms this step
      }
      const int64_t mb = mb_++;
      Depth top(depth_);
      if (mode_ == SKIP) {  // a step not sampled: counted, not recorded
        return PyObject_Vectorcall(fn, args, nargsf, kwnames);
      }
      if (mode_ == SLOW) {  // sequence lengths, a closure inside optimizer.step, ...: Python
        return slow_(mb, positional(args, nargsf), keywords(args, nargsf, kwnames))
            .release()
            .ptr();
      }
      const int64_t t0 = now_ns();
      PyObject* out = PyObject_Vectorcall(fn, args, nargsf, kwnames);
      log_->add(FWD, mb, t0, now_ns());  // also when forward raised, as an always_call hook
      if (out == nullptr) {
        return nullptr;
      }
      py::object output = py::reinterpret_steal<py::object>(out);
      if (THPVariable_Check(out)) {
        mark(out, mb);
      } else {
        for (py::handle leaf : leaves_(output)) {
          if (THPVariable_Check(leaf.ptr())) {
            mark(leaf.ptr(), mb);
          }
        }
      }
      return output.release().ptr();
    } catch (py::error_already_set& e) {
      e.restore();
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
    return nullptr;
  }

  // A step starts (microbatches count from 0, outside a backward pass: one that raised
  // never ran its end callback), or its mode changes, or it ends.
  void arm(int mode) {
    log_->in_backward.store(false);
    open_ = true;
    mode_ = mode;
    mb_ = 0;
  }
  void set_mode(int mode) { mode_ = mode; }
  void disarm() { open_ = false; }

  // A step ends: its stamps, and the next step armed in `mode` (disarmed when mode < 0: the
  // next forward then calls Attached._begin).
  py::bytes step_end(int mode) {
    py::bytes out = log_->drain();
    if (mode < 0) {
      disarm();
    } else {
      arm(mode);
    }
    return out;
  }

  // Drop the references to Python objects (the attach closed): calls pass straight through.
  void release() {
    released_ = true;
    begin_ = slow_ = leaves_ = leaf_hook_ = py::none();
  }

 private:
  // module.training: nn.Module keeps it in the instance __dict__ (a subclass that makes it a
  // property is asked the usual way)
  static bool training(PyObject* module, PyObject* dict) {
    static PyObject* key = PyUnicode_InternFromString("training");
    PyObject* value = PyDict_GetItem(dict, key);  // borrowed
    if (value != nullptr) {
      return value == Py_True;
    }
    PyObject* attr = PyObject_GetAttr(module, key);
    const bool on = attr != nullptr && PyObject_IsTrue(attr) == 1;
    Py_XDECREF(attr);
    PyErr_Clear();
    return on;
  }

  // The call's arguments after the module, as a tuple and a dict (the slow path's form).
  static py::tuple positional(PyObject* const* args, size_t nargsf) {
    const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    py::tuple out(n - 1);
    for (Py_ssize_t i = 1; i < n; ++i) {
      out[i - 1] = py::reinterpret_borrow<py::object>(args[i]);
    }
    return out;
  }
  static py::dict keywords(PyObject* const* args, size_t nargsf, PyObject* kwnames) {
    py::dict out;
    const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    for (Py_ssize_t i = 0; kwnames != nullptr && i < PyTuple_GET_SIZE(kwnames); ++i) {
      out[PyTuple_GET_ITEM(kwnames, i)] = py::reinterpret_borrow<py::object>(args[n + i]);
    }
    return out;
  }

  struct Depth {  // one more level of the module's calls, for the scope of a call
    explicit Depth(int& d) : d_(d) { ++d_; }
    ~Depth() { --d_; }
    int& d_;
  };

  // The backward of this output starts this microbatch's backward span.
  void mark(PyObject* obj, int64_t mb) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.requires_grad()) {
      return;
    }
    const auto& fn = t.grad_fn();
    if (fn) {
      fn->add_pre_hook(std::make_unique<BackwardStart>(log_, mb));
    } else {
      leaf_hook_(py::handle(obj), mb);  // a leaf: no node to hook (a tensor hook, in Python)
    }
  }

  std::shared_ptr<Log> log_;
  py::object call_, begin_, slow_, leaves_, leaf_hook_;
  bool open_ = false, released_ = false;
  int mode_ = SLOW, depth_ = 0;
  int64_t mb_ = 0;
};

// The __call__ of a recorded module's class, in C (no pybind dispatch: it runs once per
// microbatch): the instance's Forward, held by a capsule in its __dict__, runs the call; any
// other callable there (the attach was undone under a changed class) is called as is.
constexpr const char* kCapsule = "stragglers.record.native.Forward";

PyObject* recorded_call(PyObject*, PyObject* const* args, Py_ssize_t nargsf,
                        PyObject* kwnames) {
  static PyObject* key = PyUnicode_InternFromString("_stragglers_call");
  if (PyVectorcall_NARGS(nargsf) < 1) {
    PyErr_SetString(PyExc_TypeError, "__call__ needs the module");
    return nullptr;
  }
  PyObject* dict = PyObject_GenericGetDict(args[0], nullptr);
  if (dict == nullptr) {
    return nullptr;
  }
  PyObject* held = PyDict_GetItem(dict, key);  // borrowed
  PyObject* out = nullptr;
  if (held == nullptr) {
    PyErr_SetString(PyExc_AttributeError, "module has no _stragglers_call");
  } else if (PyCapsule_IsValid(held, kCapsule)) {
    auto* forward = static_cast<Forward*>(PyCapsule_GetPointer(held, kCapsule));
    out = forward->call(args, static_cast<size_t>(nargsf), kwnames, dict);
  } else {
    out = PyObject_Vectorcall(held, args + 1, PyVectorcall_NARGS(nargsf) - 1, kwnames);
  }
  Py_DECREF(dict);
  return out;
}

PyMethodDef recorded_call_def = {"__call__", reinterpret_cast<PyCFunction>(recorded_call),
                                 METH_FASTCALL | METH_KEYWORDS,
                                 "Call the module, timed when it is a microbatch's forward."};

// A capsule for a module's __dict__ holding its Forward (and a reference to it).
py::object capsule(py::object forward) {
  auto* ptr = forward.cast<Forward*>();
  PyObject* cap = PyCapsule_New(ptr, kCapsule, [](PyObject* c) {
    Py_XDECREF(static_cast<PyObject*>(PyCapsule_GetContext(c)));
  });
  if (cap == nullptr || PyCapsule_SetContext(cap, forward.release().ptr()) != 0) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(cap);
}

// The two calls the optimizer hooks make once per step, as C functions bound to a module's
// capsule (METH_O: a step's pybind11 calls — four before — went through its dispatcher, whose
// cost per call session 27's perf put at ~0.75 µs on a module's call).
Forward* forward_of(PyObject* cap) {
  return static_cast<Forward*>(PyCapsule_GetPointer(cap, kCapsule));
}

PyObject* forward_set_mode(PyObject* cap, PyObject* arg) {
  Forward* forward = forward_of(cap);
  const long mode = PyLong_AsLong(arg);
  if (forward == nullptr || (mode == -1 && PyErr_Occurred())) {
    return nullptr;
  }
  forward->set_mode(static_cast<int>(mode));
  Py_RETURN_NONE;
}

PyObject* forward_step_end(PyObject* cap, PyObject* arg) {
  Forward* forward = forward_of(cap);
  const long mode = PyLong_AsLong(arg);
  if (forward == nullptr || (mode == -1 && PyErr_Occurred())) {
    return nullptr;
  }
  try {
    return forward->step_end(static_cast<int>(mode)).release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyMethodDef set_mode_def = {"set_mode", reinterpret_cast<PyCFunction>(forward_set_mode), METH_O,
                            "set_mode(mode): how the step's next forwards are timed."};
PyMethodDef step_end_def = {"step_end", reinterpret_cast<PyCFunction>(forward_step_end), METH_O,
                            "step_end(mode) -> bytes: the step's stamps; the next step armed "
                            "in mode (disarmed when mode < 0)."};

py::object bound(PyMethodDef* def, py::handle cap) {
  PyObject* fn = PyCFunction_New(def, cap.ptr());
  if (fn == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(fn);
}

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

  // A timed call of a module: `call` is its class's original __call__ (the module first).
  Forward forward(py::object call, py::object begin, py::object slow, py::object leaves,
                  py::object leaf_hook) {
    return Forward(log_, std::move(call), std::move(begin), std::move(slow), std::move(leaves),
                   std::move(leaf_hook));
  }

  void register_ddp(py::object reducer, py::object group) {
    auto* r = reducer.cast<c10d::Reducer*>();
    auto* g = group.cast<c10d::ProcessGroup*>();
    auto owned = c10::intrusive_ptr<c10d::ProcessGroup>::unsafe_reclaim_from_nonowning(g);
    r->register_comm_hook(std::make_unique<TimedAllReduce>(owned, log_));
  }

  // The events so far (Log::drain).
  py::bytes drain() { return log_->drain(); }

  // Hooks already installed stay (DDP keeps its comm hook for life) but stamp nothing.
  void close() {
    log_->on.store(false);
    std::lock_guard<std::mutex> guard(log_->mu);
    log_->events.clear();
  }

 private:
  std::shared_ptr<Log> log_;
};


// ---- p2p completion waiter -------------------------------------------------------------------

// Run delay (ns runnable without a CPU) from an open schedstat file; -1 if unreadable.
int64_t run_delay(int fd) {
  char buf[128];
  ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) {
    return -1;
  }
  buf[n] = 0;
  unsigned long long on_cpu = 0, delay = 0;
  return std::sscanf(buf, "%llu %llu", &on_cpu, &delay) == 2 ? static_cast<int64_t>(delay) : -1;
}

// Run delay summed over gloo's communication threads (schedstat.TransportRunDelay in C++):
// the threads are found by name, the list rescanned at most once a second.
class TransportDelay {
 public:
  ~TransportDelay() {
    for (auto& kv : fds_) {
      close(kv.second);
    }
  }

  int64_t read() {
    int64_t now = now_ns();
    if (scanned_ < 0 || now - scanned_ > 1000000000LL) {
      scan();
      scanned_ = now;
    }
    int64_t total = 0;
    bool found = false;
    for (auto it = fds_.begin(); it != fds_.end();) {
      int64_t d = run_delay(it->second);
      if (d < 0) {  // the thread ended
        close(it->second);
        it = fds_.erase(it);
        continue;
      }
      total += d;
      found = true;
      ++it;
    }
    return found ? total : -1;
  }

 private:
  void scan() {
    DIR* dir = opendir("/proc/self/task");
    if (dir == nullptr) {
      return;
    }
    // Threads not followed yet are looked at again each scan: a new thread names itself once
    // it runs, so it may still carry its parent's name the first time.
    while (dirent* e = readdir(dir)) {
      std::string tid = e->d_name;
      if (tid[0] == '.' || fds_.count(tid)) {
        continue;
      }
      std::string base = "/proc/self/task/" + tid;
      int cfd = open((base + "/comm").c_str(), O_RDONLY);
      if (cfd < 0) {
        continue;
      }
      char comm[64];
      ssize_t n = ::read(cfd, comm, sizeof(comm) - 1);
      close(cfd);
      std::string name(comm, n > 0 ? static_cast<size_t>(n) : 0);
      while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) {
        name.pop_back();
      }
      if (name == "gloo_tcp_loop" || name == "pt_gloo_runloop") {
        int fd = open((base + "/schedstat").c_str(), O_RDONLY);
        if (fd >= 0) {
          fds_[tid] = fd;
        }
      }
    }
    closedir(dir);
  }

  std::map<std::string, int> fds_;
  int64_t scanned_ = -1;
};

// Waits posted p2p works in posting order on a thread of its own and stamps each completion
// there, never holding the GIL. A Python thread doing this wakes from the wait (or takes the
// next work off its queue) only when it gets the GIL: on a busy training thread that was up to
// ~5 ms, and a transfer done meanwhile was stamped that late (tens of times its real length).
class Waiter {
 public:
  struct Done {
    int64_t end = 0, prev_end = 0, cpu_wait = -1;
    bool failed = false;
    std::string error;
  };

  Waiter() : thread_([this] { run(); }) {}

  // The thread may free works' Python objects (taking the GIL): never join it holding the GIL.
  ~Waiter() {
    if (!thread_.joinable()) {
      return;
    }
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      stop();
    } else {
      stop();
    }
  }

  // Queue a work; returns its ticket for result().
  int64_t watch(c10d::Work& work) {
    auto ptr = c10::intrusive_ptr<c10d::Work>::reclaim_copy(&work);
    std::lock_guard<std::mutex> guard(mu_);
    if (stopping_) {
      throw std::runtime_error("the completion waiter was stopped");
    }
    int64_t id = next_++;
    queue_.push_back({std::move(ptr), id});
    posted_.notify_one();
    return id;
  }

  // (end ns, end ns of the work before it, cpu_wait ns or -1, error or None), once done.
  py::tuple result(int64_t id) {
    Done d;
    {
      py::gil_scoped_release nogil;
      std::unique_lock<std::mutex> lock(mu_);
      finished_.wait(lock, [&] { return done_.count(id) > 0; });
      d = std::move(done_[id]);
      done_.erase(id);
    }
    return py::make_tuple(d.end, d.prev_end, d.cpu_wait,
                          d.failed ? py::object(py::str(d.error)) : py::object(py::none()));
  }

  // Let the queued works finish, then end the thread.
  void stop() {
    {
      std::lock_guard<std::mutex> guard(mu_);
      stopping_ = true;
      posted_.notify_one();
    }
    if (thread_.joinable()) {
      thread_.join();
    }
  }

 private:
  void run() {
    pthread_setname_np(pthread_self(), "stragglers-p2p");
    int self = open("/proc/thread-self/schedstat", O_RDONLY);
    TransportDelay transport;
    int64_t last_end = 0;
    for (;;) {
      std::pair<c10::intrusive_ptr<c10d::Work>, int64_t> item;
      {
        std::unique_lock<std::mutex> lock(mu_);
        posted_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) {
          break;
        }
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      int64_t delay_from = self >= 0 ? run_delay(self) : -1;
      int64_t transport_from = transport.read();
      Done d;
      try {
        item.first->wait();
      } catch (const std::exception& e) {
        d.failed = true;
        d.error = e.what();
      }
      int64_t now = now_ns();
      // Time this thread then spent runnable without a CPU is the wake-up of a busy host, not
      // the transfer: the stamp moves back by it.
      int64_t delay_to = self >= 0 ? run_delay(self) : -1;
      int64_t late = (delay_from >= 0 && delay_to >= 0) ? std::max<int64_t>(0, delay_to - delay_from) : 0;
      int64_t transport_to = transport.read();
      d.end = now - late;
      d.prev_end = last_end;
      d.cpu_wait = (transport_from < 0 || transport_to < 0) ? -1
                   : std::max<int64_t>(0, transport_to - transport_from);
      last_end = d.end;
      item.first.reset();  // our reference goes before the next wait (no GIL needed here)
      {
        std::lock_guard<std::mutex> guard(mu_);
        done_[item.second] = std::move(d);
      }
      finished_.notify_all();
    }
    if (self >= 0) {
      close(self);
    }
  }

  std::mutex mu_;
  std::condition_variable posted_, finished_;
  std::deque<std::pair<c10::intrusive_ptr<c10d::Work>, int64_t>> queue_;
  std::unordered_map<int64_t, Done> done_;
  int64_t next_ = 0;
  bool stopping_ = false;
  std::thread thread_;  // last: it starts once the members above exist
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "stragglers.record native hooks: backward and DDP bucket stamps without Python";
  m.def("now_ns", &now_ns, "The clock the stamps are on (CLOCK_MONOTONIC), in ns.");
  m.def("call_method", []() {
    PyObject* fn = PyCFunction_New(&recorded_call_def, nullptr);
    if (fn == nullptr) {
      throw py::error_already_set();
    }
    PyObject* method = PyInstanceMethod_New(fn);  // binds the instance, as a def would
    Py_DECREF(fn);
    if (method == nullptr) {
      throw py::error_already_set();
    }
    return py::reinterpret_steal<py::object>(method);
  }, "A __call__ for a recorded module's class: runs each instance's Forward.");
  m.def("capsule", &capsule, py::arg("forward"),
        "What a module's __dict__ holds under _stragglers_call: its Forward.");
  m.def("step_calls", [](py::object cap) {
    if (!PyCapsule_IsValid(cap.ptr(), kCapsule)) {
      throw py::type_error("expected a Forward's capsule");
    }
    return py::make_tuple(bound(&set_mode_def, cap), bound(&step_end_def, cap));
  }, py::arg("capsule"), "(set_mode, step_end) of a capsule's Forward, as plain C functions.");
  py::class_<Forward>(m, "Forward")
      .def("arm", &Forward::arm, py::arg("mode"))
      .def("release", &Forward::release);
  py::class_<Stamps>(m, "Stamps")
      .def(py::init<>())
      .def("mark_backward", &Stamps::mark_backward, py::arg("output"), py::arg("mb"))
      .def("start", &Stamps::start, py::arg("mb"))
      .def("forward", &Stamps::forward, py::arg("call"), py::arg("begin"), py::arg("slow"),
           py::arg("leaves"), py::arg("leaf_hook"))
      .def("register_ddp", &Stamps::register_ddp, py::arg("reducer"), py::arg("group"))
      .def("drain", &Stamps::drain)
      .def("close", &Stamps::close);
  py::class_<Waiter>(m, "Waiter")
      .def(py::init<>())
      .def("watch", &Waiter::watch, py::arg("work"))
      .def("result", &Waiter::result, py::arg("ticket"))
      .def("stop", &Waiter::stop, py::call_guard<py::gil_scoped_release>());
}
