// Host-side fast paths: the work on the calling thread around a compiled program's run.
//
// A LeNet-5 step at batch 1 runs its programs in ~100 us; what happens around them in Python
// (checking the arguments, converting every output, reading the index checks with numpy,
// comparing buffers to see whether an update was written in place) cost about as much again.
// These functions do that bookkeeping in one call each; ratex/dynamo/program.py and
// ratex/core/launch.py call them where the library is loaded and keep Python twins otherwise.
//
// Functions (registered as global ffi functions by RatexRegisterHost):
//   ratex.host.bad_row(rows) -> int
//       `rows`: a program's index checks (tvm_lowering/ops/bounds.py: an int64 [n, 7] host
//       tensor of `site, sub, dim, low, high, max, ~min`). Returns the first row whose indices
//       left [low, high) (`max >= high or min < low`), or -1 where every index was in range.
//   ratex.host.region(fn, n_outs, in_place) -> call
//       `fn`: a compiled program's entry; `n_outs`: its outputs before the index checks (-1: it
//       has none); `in_place`: a flat list of (input, output) pairs where the output is the new
//       value of the input, written back into it by the caller.
//   call(*inputs) -> [status, outputs...]
//       status 0: `outputs` are the program's (the checks taken off), with None for each output
//       of an `in_place` pair that the program wrote into its input's own buffer (the write-back
//       has nothing to do, and the output need not become a Python object).
//       status 1: an index was out of range: `outputs` are all of them, checks last, for the
//       caller to name the op.
//       status 2: an input is not a compact tensor with elements; nothing ran: the caller makes
//       it one (a contiguous copy, an empty TVM array) and calls `fn` itself.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace {

namespace ffi = tvm::ffi;

constexpr int kRowWidth = 7;  // site, sub, dim, low, high, max, ~min

int64_t bad_row_of(const DLTensor* t) {
  if (t->device.device_type != kDLCPU || t->dtype.code != kDLInt || t->dtype.bits != 64 || t->dtype.lanes != 1 ||
      t->ndim != 2 || t->shape[1] != kRowWidth || !ffi::IsContiguous(*t)) {
    TVM_FFI_THROW(ValueError) << "ratex.host.bad_row: index checks must be a compact int64 [n, 7] host tensor";
  }
  const int64_t* row = reinterpret_cast<const int64_t*>(static_cast<const char*>(t->data) + t->byte_offset);
  for (int64_t r = 0; r < t->shape[0]; ++r, row += kRowWidth) {
    if (row[5] >= row[4] || ~row[6] < row[3]) return r;
  }
  return -1;
}

int64_t bad_row(ffi::AnyView rows) {
  auto t = rows.try_cast<DLTensor*>();
  if (!t.has_value()) TVM_FFI_THROW(TypeError) << "ratex.host.bad_row takes a tensor";
  return bad_row_of(*t);
}

int64_t numel(const DLTensor* t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; ++d) n *= t->shape[d];
  return n;
}

const char* address(const DLTensor* t) { return static_cast<const char*>(t->data) + t->byte_offset; }

// Whether `out` is `in`'s buffer, as the write-back sees it: the same first element and shape.
bool same_buffer(const DLTensor* in, const DLTensor* out) {
  if (address(in) != address(out) || in->ndim != out->ndim || in->dtype.code != out->dtype.code ||
      in->dtype.bits != out->dtype.bits || in->dtype.lanes != out->dtype.lanes) {
    return false;
  }
  for (int d = 0; d < in->ndim; ++d) {
    if (in->shape[d] != out->shape[d]) return false;
  }
  return true;
}

struct Region {
  ffi::Function fn;
  int64_t n_outs;
  std::vector<std::pair<int64_t, int64_t>> in_place;
};

void call_region(const Region& region, ffi::PackedArgs args, ffi::Any* rv) {
  for (int i = 0; i < args.size(); ++i) {
    auto t = args[i].try_cast<DLTensor*>();
    if (t.has_value() && (numel(*t) == 0 || !ffi::IsContiguous(**t))) {
      *rv = ffi::Array<ffi::Any>{ffi::Any(int64_t{2})};
      return;
    }
  }
  ffi::Any result;
  region.fn.CallPacked(args.data(), args.size(), &result);
  ffi::Array<ffi::Any> outs = result.cast<ffi::Array<ffi::Any>>();
  int64_t status = 0;
  size_t n = outs.size();
  if (region.n_outs >= 0 && static_cast<int64_t>(n) > region.n_outs) {
    auto rows = outs[n - 1].try_cast<ffi::Tensor>();
    if (!rows.has_value()) TVM_FFI_THROW(RuntimeError) << "ratex.host.region: the index checks are not a tensor";
    if (bad_row_of(rows->GetDLTensorPtr()) >= 0) {
      status = 1;
    } else {
      n -= 1;
    }
  }
  std::vector<ffi::Any> back;
  back.reserve(n + 1);
  back.emplace_back(status);
  for (size_t j = 0; j < n; ++j) back.emplace_back(outs[j]);
  if (status == 0) {
    for (const auto& [i, j] : region.in_place) {
      if (i >= args.size() || j >= static_cast<int64_t>(n)) continue;
      auto in = args[static_cast<int>(i)].try_cast<DLTensor*>();
      auto out = back[j + 1].try_cast<ffi::Tensor>();
      if (in.has_value() && out.has_value() && same_buffer(*in, out->GetDLTensorPtr())) back[j + 1] = ffi::Any();
    }
  }
  *rv = ffi::Array<ffi::Any>(back.begin(), back.end());
}

ffi::Function region(ffi::Function fn, int64_t n_outs, ffi::Array<ffi::Any> in_place) {
  auto prepared = std::make_shared<Region>();
  prepared->fn = std::move(fn);
  prepared->n_outs = n_outs;
  if (in_place.size() % 2) TVM_FFI_THROW(ValueError) << "ratex.host.region: in_place must list (input, output) pairs";
  for (size_t k = 0; k < in_place.size(); k += 2) {
    prepared->in_place.emplace_back(in_place[k].cast<int64_t>(), in_place[k + 1].cast<int64_t>());
  }
  return ffi::Function::FromPacked(
      [prepared](ffi::PackedArgs args, ffi::Any* rv) { call_region(*prepared, args, rv); });
}

}  // namespace

// Registers ratex.host.*. Returns 0, or -1 with the ffi error set.
extern "C" int RatexRegisterHost() {
  TVM_FFI_SAFE_CALL_BEGIN();
  ffi::Function::SetGlobal("ratex.host.bad_row", ffi::Function::FromTyped(bad_row), true);
  ffi::Function::SetGlobal("ratex.host.region", ffi::Function::FromTyped(region), true);
  TVM_FFI_SAFE_CALL_END();
}
