// The native program runner: compiled CPU programs run on a C++ thread that never takes the GIL.
//
// ratex overlaps a step's execution with the tracing of the next one. A Python thread running
// the programs needs the GIL twice per program (to start it and to hand its outputs back),
// while the tracing thread holds the GIL all the time except inside torch's op calls, which
// drop and retake it for every op. Each such drop wakes the waiting runner, which mostly
// loses the race and sleeps again: for a small model the context switches cost more than
// the overlap gains. Here the tracing thread launches a run (one ffi call), and collects
// its outputs when it next needs them (ratex/core/launch.py); the run itself, the reads of
// an earlier run's outputs and the buffer bookkeeping happen on this thread, with no Python.
//
// Functions (registered as global ffi functions by RatexRegisterRunner):
//   ratex.runner.prepare(fn, own, donate, constant) -> launcher
//       `fn`: a compiled program's entry (a Relax VM function returning a tuple).
//       `own`: give every output its own buffer (ENABLE_PARAM_ALIASING; executor.py's
//       _own_buffers is the Python twin), except output j where (i, j) is in the flat list
//       `donate` of (input, output) pairs; with `own`, outputs listed in `constant` (folded
//       constants: the same buffer every run) are copied too.
//   launcher(*inputs) -> ticket (int)
//       Queues one run. An input is a tensor, or the int `ticket << 20 | k`: output k of an
//       earlier run, read when this run starts (runs go in launch order).
//   ratex.runner.wait(ticket, timeout) -> [start, end, outputs...], or [] after timeout s
//       Blocks until the run is done (tvm-ffi releases the GIL meanwhile) and returns its
//       times (seconds on the clock of Python's time.perf_counter) and outputs (tvm-ffi
//       tensors: Python makes torch tensors of the few it reads), or raises its error. The
//       timeout lets Python handle a Ctrl-C while a long program runs.
//   ratex.runner.done(ticket) -> bool;  ratex.runner.release(ticket): forget a collected run.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include <pthread.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

namespace ffi = tvm::ffi;

constexpr int kIndexBits = 20;

struct Program {
  ffi::Function fn;
  bool own = false;
  std::set<std::pair<int64_t, int64_t>> donate;
  std::vector<int64_t> constant;
};

struct Run {
  std::shared_ptr<const Program> program;
  std::vector<ffi::Any> inputs;
  std::vector<std::tuple<size_t, std::shared_ptr<Run>, int64_t>> reads;  // (input position, run, output)
  std::vector<ffi::Any> outputs;
  std::string error;  // set when the run failed
  double start = 0, end = 0;
  bool done = false;  // guarded by Runner::mutex_
};

double now() {
  // steady_clock is CLOCK_MONOTONIC on Linux, as time.perf_counter is.
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// A host buffer from malloc for a copied output.
struct HostAlloc {
  size_t bytes;
  void AllocData(DLTensor* t) {
    t->data = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (t->data == nullptr) throw std::bad_alloc();
  }
  void FreeData(DLTensor* t) { std::free(t->data); }
};

size_t numel(const DLTensor* t) {
  size_t n = 1;
  for (int d = 0; d < t->ndim; ++d) n *= static_cast<size_t>(t->shape[d]);
  return n;
}

const void* data_of(const ffi::Any& x) {
  auto t = x.as<ffi::Tensor>();
  if (!t.has_value()) return nullptr;
  const DLTensor* d = t->GetDLTensorPtr();
  if (numel(d) == 0) return nullptr;
  return static_cast<const char*>(d->data) + d->byte_offset;
}

// A copy of a compact host tensor in a buffer of its own.
ffi::Any copy_of(const ffi::Any& x) {
  ffi::Tensor t = x.cast<ffi::Tensor>();
  const DLTensor* d = t.GetDLTensorPtr();
  if (d->device.device_type != kDLCPU || !t.IsContiguous()) {
    TVM_FFI_THROW(RuntimeError) << "ratex runner: an output to copy is not a compact host tensor";
  }
  size_t bytes = numel(d) * ((d->dtype.bits * d->dtype.lanes + 7) / 8);
  ffi::Tensor out = ffi::Tensor::FromNDAlloc(HostAlloc{bytes}, ffi::ShapeView(d->shape, d->ndim), d->dtype, d->device);
  std::memcpy(const_cast<void*>(out.GetDLTensorPtr()->data), static_cast<const char*>(d->data) + d->byte_offset, bytes);
  return out;
}

// Give each output its own buffer: no output may share one with an input (unless donated) or
// with another output, since a later run may write it in place.
void own_buffers(const Program& p, const std::vector<ffi::Any>& inputs, std::vector<ffi::Any>& outs) {
  for (int64_t j : p.constant) outs.at(j) = copy_of(outs.at(j));
  std::unordered_map<const void*, int64_t> owner;  // buffer -> input i (>= 0) or output ~j
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (const void* ptr = data_of(inputs[i])) owner.emplace(ptr, static_cast<int64_t>(i));
  }
  for (size_t j = 0; j < outs.size(); ++j) {
    const void* ptr = data_of(outs[j]);
    if (ptr == nullptr) continue;
    auto it = owner.find(ptr);
    if (it == owner.end()) {
      owner.emplace(ptr, ~static_cast<int64_t>(j));
    } else if (it->second >= 0 && p.donate.count({it->second, static_cast<int64_t>(j)})) {
      it->second = ~static_cast<int64_t>(j);
    } else {
      outs[j] = copy_of(outs[j]);
    }
  }
}

class Runner {
 public:
  // The process's runner; a forked child, which has no copy of the parent's thread, gets its own.
  // (A fork handler forgets the parent's: getpid() here was a system call on every call.)
  static Runner& get() {
    static std::mutex guard;
    std::lock_guard<std::mutex> lock(guard);
    if (current_ == nullptr) {
      static const int forget_in_child = pthread_atfork(nullptr, nullptr, [] { current_ = nullptr; });
      (void)forget_in_child;
      current_ = new Runner();  // never destroyed: its thread outlives static teardown
    }
    return *current_;
  }

  int64_t launch(std::shared_ptr<Run> run) {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t ticket = next_++;
    runs_[ticket] = run;
    queue_.push_back(std::move(run));
    if (!thread_.joinable()) {
      thread_ = std::thread([this] {
        pthread_setname_np(pthread_self(), "ratex-runner");  // as top, perf and /proc name it
        work();
      });
    }
    if (sleeping_) wake_.notify_one();  // a polling runner finds the run by itself (see work)
    return ticket;
  }

  std::shared_ptr<Run> find(int64_t ticket) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = runs_.find(ticket);
    if (it == runs_.end()) TVM_FFI_THROW(ValueError) << "ratex runner: no run with ticket " << ticket;
    return it->second;
  }

  bool wait(const Run& run, double timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!run.done) wake_.notify_one();  // the caller blocks anyway: no need for a polling runner's next look
    return done_.wait_for(lock, std::chrono::duration<double>(timeout), [&] { return run.done; });
  }

  bool done(const Run& run) {
    std::lock_guard<std::mutex> lock(mutex_);
    return run.done;
  }

  void release(int64_t ticket) {
    std::shared_ptr<Run> run;
    bool done;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = runs_.find(ticket);
      if (it == runs_.end()) return;
      run = std::move(it->second);
      runs_.erase(it);
      done = run->done;
    }
    // A later run may still read this one's outputs (it holds the run); the inputs are this
    // run's alone, and once it is done, no other thread touches them: they go now, on this
    // thread (see execute).
    if (done) run->inputs.clear();
  }

 private:
  void work() {
    for (;;) {
      std::shared_ptr<Run> run;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        // Waking a sleeping thread is a system call on the launching (tracing) thread, and on
        // a VM an inter-processor interrupt. So for a while after its last run the runner
        // looks at the queue every kPoll by itself, and launch() wakes it only once it has
        // gone to sleep for good.
        auto poll_until = std::chrono::steady_clock::now() + kPollFor;
        while (queue_.empty()) {
          if (std::chrono::steady_clock::now() < poll_until) {
            wake_.wait_for(lock, kPoll);
          } else {
            sleeping_ = true;
            wake_.wait(lock, [&] { return !queue_.empty(); });
            sleeping_ = false;
          }
        }
        run = std::move(queue_.front());
        queue_.pop_front();
      }
      execute(*run);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        run->done = true;
        run.reset();  // runs_ holds it until release, which needs this lock: never the last reference
      }
      done_.notify_all();
    }
  }

  static void execute(Run& run) {
    run.start = now();
    try {
      for (auto& [pos, source, k] : run.reads) {
        if (!source->error.empty()) {
          TVM_FFI_THROW(RuntimeError) << "an input comes from a program that failed (" << source->error << ")";
        }
        run.inputs.at(pos) = source->outputs.at(k);
      }
      // The earlier runs may go now: a run kept alive past this point keeps its outputs, which
      // Python may have dropped (last step's gradients), out of TVM's storage pool, and the
      // program allocates (and page-faults in) fresh memory instead.
      run.reads.clear();
      std::vector<ffi::AnyView> args(run.inputs.begin(), run.inputs.end());
      ffi::Any result;
      run.program->fn.CallPacked(args.data(), static_cast<int32_t>(args.size()), &result);
      ffi::Array<ffi::Any> outs = result.cast<ffi::Array<ffi::Any>>();
      run.outputs.assign(outs.begin(), outs.end());
      if (run.program->own) own_buffers(*run.program, run.inputs, run.outputs);
    } catch (const ffi::Error& e) {
      run.error = e.kind() + ": " + e.message();
    } catch (const std::exception& e) {
      run.error = std::string("Error: ") + e.what();
    }
    // The inputs stay until the run is released, so that they are let go on the thread that
    // calls release. An input from Python (a torch tensor) gives its last reference back
    // through torch's DLPack deleter, which takes the GIL: done here, at LeNet-5 batch 1 that
    // was ~9 waits for the GIL a step on this thread, each a hand-over the tracing thread paid
    // for too.
    run.end = now();
  }

  static constexpr auto kPoll = std::chrono::microseconds(100);
  static constexpr auto kPollFor = std::chrono::milliseconds(20);
  static inline Runner* current_ = nullptr;
  bool sleeping_ = false;  // in work(), waiting for launch() to wake it
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::deque<std::shared_ptr<Run>> queue_;
  std::unordered_map<int64_t, std::shared_ptr<Run>> runs_;
  int64_t next_ = 1;
  std::thread thread_;
};

std::vector<int64_t> ints(const ffi::Array<ffi::Any>& xs) {
  std::vector<int64_t> out;
  for (const ffi::Any& x : xs) out.push_back(x.cast<int64_t>());
  return out;
}

ffi::Function prepare(ffi::Function fn, bool own, ffi::Array<ffi::Any> donate, ffi::Array<ffi::Any> constant) {
  auto program = std::make_shared<Program>();
  program->fn = std::move(fn);
  program->own = own;
  std::vector<int64_t> pairs = ints(donate);
  if (pairs.size() % 2) TVM_FFI_THROW(ValueError) << "ratex runner: donate must list (input, output) pairs";
  for (size_t i = 0; i < pairs.size(); i += 2) program->donate.emplace(pairs[i], pairs[i + 1]);
  program->constant = ints(constant);
  return ffi::Function::FromPacked([program](ffi::PackedArgs args, ffi::Any* rv) {
    Runner& runner = Runner::get();
    auto run = std::make_shared<Run>();
    run->program = program;
    run->inputs.reserve(args.size());
    for (int i = 0; i < args.size(); ++i) {
      if (auto code = args[i].try_cast<int64_t>(); code.has_value() && args[i].type_index() == ffi::TypeIndex::kTVMFFIInt) {
        run->reads.emplace_back(static_cast<size_t>(i), runner.find(*code >> kIndexBits),
                                *code & ((int64_t{1} << kIndexBits) - 1));
        run->inputs.emplace_back(nullptr);
      } else {
        run->inputs.emplace_back(args[i]);
      }
    }
    *rv = runner.launch(std::move(run));
  });
}

ffi::Array<ffi::Any> wait(int64_t ticket, double timeout) {
  Runner& runner = Runner::get();
  std::shared_ptr<Run> run = runner.find(ticket);
  ffi::Array<ffi::Any> out;
  if (!runner.wait(*run, timeout)) return out;
  if (!run->error.empty()) TVM_FFI_THROW(RuntimeError) << run->error;
  out.reserve(run->outputs.size() + 2);
  out.push_back(run->start);
  out.push_back(run->end);
  for (const ffi::Any& x : run->outputs) out.push_back(x);
  return out;
}

}  // namespace

// Registers ratex.runner.*. Returns 0, or -1 with the ffi error set.
extern "C" int RatexRegisterRunner() {
  TVM_FFI_SAFE_CALL_BEGIN();
  ffi::Function::SetGlobal("ratex.runner.prepare", ffi::Function::FromTyped(prepare), true);
  ffi::Function::SetGlobal("ratex.runner.wait", ffi::Function::FromTyped(wait), true);
  ffi::Function::SetGlobal("ratex.runner.done", ffi::Function::FromTyped([](int64_t ticket) {
    Runner& runner = Runner::get();
    return runner.done(*runner.find(ticket));
  }), true);
  ffi::Function::SetGlobal("ratex.runner.release", ffi::Function::FromTyped([](int64_t ticket) {
    Runner::get().release(ticket);
  }), true);
  TVM_FFI_SAFE_CALL_END();
}
