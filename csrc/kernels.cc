// Native `ratex.lib.*` kernels: the same packed functions as ratex/core/kernels.py, in C++.
//
// Compiled programs run on ratex's executor thread while the Python thread traces the
// next step. The Python kernels need the GIL for every call, so each call waits for the
// tracing thread; these run ATen's kernels without touching Python at all.
//
// The calling convention is the Python one (tvm_lowering/ops/library.py and
// library_dispatch.py emit the calls): tensors first, then the attributes as a JSON
// string, then, for the destination-passing `*_out` kernels, the output to write.
// Tensors are viewed as at::Tensor without copies; results of the other kernels are
// handed back as ffi Tensors that own the at::Tensor they were made from.
//
// Built against a torch with CUDA (RATEX_WITH_CUDA, see CMakeLists.txt), the kernels take
// CUDA tensors too, and run torch's CUDA kernels on the stream TVM runs the program on
// (tvm-ffi's environment stream), so they queue in order with TVM's own kernels.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_log_softmax.h>
#include <ATen/ops/_log_softmax_backward_data.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/_softmax_backward_data.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/avg_pool2d_backward.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/conv2d.h>
#include <ATen/ops/conv_transpose2d.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/embedding_dense_backward.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/max_pool2d_with_indices.h>
#include <ATen/ops/max_pool2d_with_indices_backward.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/Config.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#ifdef RATEX_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#if AT_MKLDNN_ENABLED()
namespace at::native {
// ATen's oneDNN product (ATen/native/mkldnn/Matmul.h, a header torch does not install):
// result = beta * result + alpha * (mat1 @ mat2) for 2-D or 3-D operands of any strides.
TORCH_API void mkldnn_matmul(const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor& result, float beta,
                             float alpha);
}  // namespace at::native
#endif

namespace {

namespace ffi = tvm::ffi;

// ---------------------------------------------------------------------------------------
// The attributes: small JSON objects written by Python's json.dumps (numbers, booleans,
// null, strings, lists and nested objects; no string escapes beyond \" and \\ occur).

struct Json {
  enum Kind { kNull, kBool, kNumber, kString, kList, kObject } kind = kNull;
  bool boolean = false;
  double number = 0;
  bool integral = false;
  std::string text;
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> fields;

  const Json* find(const std::string& key) const {
    for (const auto& [name, value] : fields) {
      if (name == key) return &value;
    }
    return nullptr;
  }
  const Json& operator[](const std::string& key) const {
    const Json* value = find(key);
    if (value == nullptr) TVM_FFI_THROW(ValueError) << "kernel attributes have no field '" << key << "'";
    return *value;
  }
  bool is_null() const { return kind == kNull; }
  bool as_bool() const {
    if (kind == kBool) return boolean;
    if (kind == kNumber) return number != 0;
    TVM_FFI_THROW(TypeError) << "kernel attribute: expected a boolean";
  }
  double as_double() const {
    if (kind == kBool) return boolean ? 1 : 0;  // json.dumps writes Python's True as true
    if (kind != kNumber) TVM_FFI_THROW(TypeError) << "kernel attribute: expected a number";
    return number;
  }
  int64_t as_int() const { return static_cast<int64_t>(as_double()); }
  std::vector<int64_t> as_ints() const {
    if (kind != kList) TVM_FFI_THROW(TypeError) << "kernel attribute: expected a list of integers";
    std::vector<int64_t> out;
    for (const Json& item : items) out.push_back(item.as_int());
    return out;
  }
  std::vector<bool> as_bools() const {
    std::vector<bool> out;
    for (const Json& item : items) out.push_back(item.as_bool());
    return out;
  }
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& text) : s_(text) {}

  Json parse() {
    Json value = value_();
    skip_space();
    if (pos_ != s_.size()) fail("trailing characters");
    return value;
  }

 private:
  [[noreturn]] void fail(const char* what) {
    TVM_FFI_THROW(ValueError) << "malformed kernel attributes (" << what << " at " << pos_ << "): " << s_;
  }
  void skip_space() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  bool consume(const char* word) {
    size_t n = std::char_traits<char>::length(word);
    if (s_.compare(pos_, n, word) != 0) return false;
    pos_ += n;
    return true;
  }
  void expect(char c) {
    skip_space();
    if (pos_ >= s_.size() || s_[pos_] != c) fail("unexpected character");
    ++pos_;
  }
  std::string string_() {
    expect('"');
    std::string out;
    while (pos_ < s_.size() && s_[pos_] != '"') {
      if (s_[pos_] == '\\' && pos_ + 1 < s_.size()) ++pos_;
      out.push_back(s_[pos_++]);
    }
    if (pos_ >= s_.size()) fail("unterminated string");
    ++pos_;
    return out;
  }
  Json value_() {
    skip_space();
    if (pos_ >= s_.size()) fail("unexpected end");
    Json v;
    char c = s_[pos_];
    if (c == '{') {
      v.kind = Json::kObject;
      ++pos_;
      skip_space();
      if (pos_ < s_.size() && s_[pos_] == '}') return ++pos_, v;
      do {
        std::string key = string_();
        expect(':');
        v.fields.emplace_back(std::move(key), value_());
        skip_space();
      } while (pos_ < s_.size() && s_[pos_] == ',' && ++pos_);
      expect('}');
    } else if (c == '[') {
      v.kind = Json::kList;
      ++pos_;
      skip_space();
      if (pos_ < s_.size() && s_[pos_] == ']') return ++pos_, v;
      do {
        v.items.push_back(value_());
        skip_space();
      } while (pos_ < s_.size() && s_[pos_] == ',' && ++pos_);
      expect(']');
    } else if (c == '"') {
      v.kind = Json::kString;
      v.text = string_();
    } else if (consume("true")) {
      v.kind = Json::kBool;
      v.boolean = true;
    } else if (consume("false")) {
      v.kind = Json::kBool;
    } else if (consume("null")) {
      v.kind = Json::kNull;
    } else {
      const char* begin = s_.c_str() + pos_;
      char* end = nullptr;
      v.kind = Json::kNumber;
      v.number = std::strtod(begin, &end);
      if (end == begin) fail("expected a value");
      pos_ += end - begin;
    }
    return v;
  }

  const std::string& s_;
  size_t pos_ = 0;
};

Json attrs_of(const ffi::AnyView& arg) {
  auto text = arg.try_cast<ffi::String>();
  if (!text.has_value()) TVM_FFI_THROW(TypeError) << "kernel attributes must be a JSON string, got " << arg.GetTypeKey();
  return JsonParser(std::string(*text)).parse();
}

// ---------------------------------------------------------------------------------------
// Tensors.

at::ScalarType scalar_type(DLDataType t) {
  if (t.lanes == 1) {
    switch (t.code) {
      case kDLFloat:
        if (t.bits == 32) return at::kFloat;
        if (t.bits == 64) return at::kDouble;
        if (t.bits == 16) return at::kHalf;
        break;
      case kDLBfloat:
        if (t.bits == 16) return at::kBFloat16;
        break;
      case kDLInt:
        if (t.bits == 64) return at::kLong;
        if (t.bits == 32) return at::kInt;
        if (t.bits == 16) return at::kShort;
        if (t.bits == 8) return at::kChar;
        break;
      case kDLUInt:
        if (t.bits == 8) return at::kByte;
        if (t.bits == 1) return at::kBool;
        break;
      case kDLBool:
        return at::kBool;
    }
  }
  TVM_FFI_THROW(TypeError) << "no torch dtype for DLPack dtype code " << int(t.code) << " bits " << int(t.bits);
}

DLDataType dl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return {kDLFloat, 32, 1};
    case at::kDouble: return {kDLFloat, 64, 1};
    case at::kHalf: return {kDLFloat, 16, 1};
    case at::kBFloat16: return {kDLBfloat, 16, 1};
    case at::kLong: return {kDLInt, 64, 1};
    case at::kInt: return {kDLInt, 32, 1};
    case at::kShort: return {kDLInt, 16, 1};
    case at::kChar: return {kDLInt, 8, 1};
    case at::kByte: return {kDLUInt, 8, 1};
    case at::kBool: return {kDLBool, 8, 1};
    default: TVM_FFI_THROW(TypeError) << "no DLPack dtype for torch dtype " << c10::toString(t);
  }
}

// The torch device of a DLPack device these kernels handle.
at::Device torch_device(DLDevice device, int i) {
  if (device.device_type == kDLCPU) return at::Device(at::kCPU);
#ifdef RATEX_WITH_CUDA
  if (device.device_type == kDLCUDA) return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device.device_id));
  TVM_FFI_THROW(ValueError) << "argument " << i << " is neither a CPU nor a CUDA tensor (DLPack device type "
                            << int(device.device_type) << ")";
#else
  TVM_FFI_THROW(ValueError) << "argument " << i << " is not a CPU tensor (DLPack device type " << int(device.device_type)
                            << "), and this library was built without CUDA";
#endif
}

DLDevice dl_device(const at::Device& device) {
  if (device.is_cpu()) return DLDevice{kDLCPU, 0};
#ifdef RATEX_WITH_CUDA
  if (device.is_cuda()) return DLDevice{kDLCUDA, device.index()};
#endif
  TVM_FFI_THROW(ValueError) << "no DLPack device for torch device " << device.str();
}

// A view of argument `i` as an at::Tensor. The caller keeps the tensor alive for the call.
at::Tensor tensor_arg(const ffi::PackedArgs& args, int i) {
  auto dl = args[i].try_cast<DLTensor*>();
  if (!dl.has_value()) TVM_FFI_THROW(TypeError) << "argument " << i << " must be a tensor, got " << args[i].GetTypeKey();
  const DLTensor* t = *dl;
  at::Device device = torch_device(t->device, i);
  std::vector<int64_t> sizes(t->shape, t->shape + t->ndim), strides(t->ndim);
  if (t->strides != nullptr) {
    strides.assign(t->strides, t->strides + t->ndim);
  } else {
    for (int64_t d = t->ndim - 1, step = 1; d >= 0; --d) strides[d] = step, step *= sizes[d];
  }
  void* data = static_cast<char*>(t->data) + t->byte_offset;
  return at::from_blob(data, sizes, strides, at::TensorOptions().dtype(scalar_type(t->dtype)).device(device));
}

// Keeps the at::Tensor whose memory an ffi Tensor lends; freed with the ffi Tensor.
struct ATenOwner {
  at::Tensor tensor;
  void AllocData(DLTensor* t) { t->data = tensor.data_ptr(); }
  void FreeData(DLTensor*) { tensor.reset(); }
};

// A kernel's result as a new ffi Tensor (never an input or a view of one: buffer
// donation, tvm_lowering/inplace.py, relies on that, as the Python kernels say).
ffi::Tensor to_ffi(const at::Tensor& result) {
  at::Tensor t = result.contiguous();
  ffi::ShapeView shape(t.sizes().data(), t.dim());
  return ffi::Tensor::FromNDAlloc(ATenOwner{t}, shape, dl_type(t.scalar_type()), dl_device(t.device()));
}

at::Tensor maybe_t(const at::Tensor& x, bool transposed) { return transposed ? x.transpose(-2, -1) : x; }

void check_arity(const char* name, const ffi::PackedArgs& args, int n) {
  if (args.size() != n) TVM_FFI_THROW(TypeError) << "ratex.lib." << name << " takes " << n << " arguments, got " << args.size();
}

// ---------------------------------------------------------------------------------------
// The kernels (argument order as in ratex/core/kernels.py).

// Float32 products on the CPU: oneDNN or ATen's own choice (MKL's sgemm).
//
// ATen runs a float32 mm/bmm as MKL's sgemm. MKL takes its AVX-512 kernels only on Intel
// CPUs; elsewhere (AMD's Zen 4 and 5, which have AVX-512) it runs a generic path at half the
// speed or less, while oneDNN, which picks its kernels by the ISA the CPU reports, runs the same
// product several times faster there (scripts/kernel_profile.py shows the products as most of an
// MLP's or a transformer's training step). oneDNN has a fixed cost per call that small products
// do not amortize and is far slower for matrix-vector shapes, so those stay with ATen. `gemm_onednn`
// (ratex.lib.set_onednn_gemm, from RATEX_ONEDNN_GEMM) turns the path off.
std::atomic<bool> gemm_onednn{AT_MKLDNN_ENABLED()};  // off too once oneDNN refuses a product (onednn_matmul)
constexpr int64_t kOneDnnMinMacs = int64_t(1) << 21;
constexpr int64_t kOneDnnMinSide = 8;

// Whether out = a @ b (2-D, or 3-D of one batch) goes to oneDNN; see above.
bool onednn_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  if (!gemm_onednn || !out.device().is_cpu() || !at::globalContext().userEnabledMkldnn()) return false;
  for (const at::Tensor* t : {&a, &b, &out}) {
    if (t->scalar_type() != at::kFloat) return false;
  }
  int64_t d = a.dim();
  if ((d != 2 && d != 3) || b.dim() != d || out.dim() != d || !out.is_contiguous()) return false;
  int64_t batch = d == 3 ? a.size(0) : 1, m = a.size(-2), k = a.size(-1), n = b.size(-1);
  if (d == 3 && (b.size(0) != batch || out.size(0) != batch)) return false;
  if (b.size(-2) != k || out.size(-2) != m || out.size(-1) != n) return false;  // ATen says what is wrong
  return std::min({m, k, n}) >= kOneDnnMinSide && batch * m * k * n >= kOneDnnMinMacs;
}

struct Operands {
  at::Tensor a, b, out;
};

// matmul's a @ b -> out as 2-D or 3-D products, without copies: a's batch dimensions folded into
// its rows where b is a matrix (a row-major a, as ATen's matmul folds it), or the batch
// dimensions of both merged into one; else the operands as they are.
Operands folded(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  if (out.dim() != a.dim() || !out.is_contiguous()) return {a, b, out};
  if (a.dim() > 2 && b.dim() == 2 && a.stride(-1) == 1 && a.stride(-2) == a.size(-1)) {
    at::Tensor rows = a.flatten(0, -2);
    if (rows.is_alias_of(a)) return {rows, b, out.flatten(0, -2)};
  } else if (a.dim() > 3 && b.dim() == a.dim()) {
    at::Tensor a3 = a.flatten(0, -3), b3 = b.flatten(0, -3);
    if (a3.is_alias_of(a) && b3.is_alias_of(b)) return {a3, b3, out.flatten(0, -3)};
  }
  return {a, b, out};
}

// out = beta * out + alpha * (a @ b) through oneDNN, where onednn_product(a, b, out); false
// where oneDNN refused the product (a torch or CPU whose oneDNN takes no float32 matmul): the
// path is then off for the process, and the caller computes the product with ATen, which
// writes all of `out`.
bool onednn_matmul(const Operands& p, double beta, double alpha) {
#if AT_MKLDNN_ENABLED()
  at::internal::lazy_init_num_threads();  // oneDNN's OpenMP on this thread: torch's thread count, as MKL's
  try {
    at::native::mkldnn_matmul(p.a, p.b, p.out, static_cast<float>(beta), static_cast<float>(alpha));
    return true;
  } catch (const c10::Error&) {
    gemm_onednn = false;
  }
#endif
  return false;
}

void matmul_into(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  Operands p = folded(a, b, out);
  if (onednn_product(p.a, p.b, p.out) && onednn_matmul(p, 0, 1)) return;
  at::matmul_out(out, a, b);
}

template <at::Tensor& (*Product)(at::Tensor&, const at::Tensor&, const at::Tensor&)>
void product_into(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  if (onednn_product(a, b, out) && onednn_matmul({a, b, out}, 0, 1)) return;
  Product(out, a, b);
}

// mm_out, bmm_out, matmul_out: (a, b, attrs {"ta", "tb"}, out), the flags folding a swap of
// an operand's last two axes into a strided view.
template <void (*Product)(const at::Tensor&, const at::Tensor&, at::Tensor&)>
void product_out(ffi::PackedArgs args, ffi::Any*) {
  check_arity("mm_out/bmm_out/matmul_out", args, 4);
  Json cfg = attrs_of(args[2]);
  at::Tensor out = tensor_arg(args, 3);
  Product(maybe_t(tensor_arg(args, 0), cfg["ta"].as_bool()), maybe_t(tensor_arg(args, 1), cfg["tb"].as_bool()), out);
}

void addmm_out(ffi::PackedArgs args, ffi::Any*) {
  check_arity("addmm_out", args, 5);
  Json cfg = attrs_of(args[3]);
  at::Tensor out = tensor_arg(args, 4), bias = tensor_arg(args, 0);
  at::Tensor a = maybe_t(tensor_arg(args, 1), cfg["ta"].as_bool()), b = maybe_t(tensor_arg(args, 2), cfg["tb"].as_bool());
  double beta = cfg["beta"].as_double(), alpha = cfg["alpha"].as_double();
  // oneDNN adds what `out` holds (scaled by beta): the bias, broadcast, goes there first. With
  // beta 0 the bias is not read at all, as addmm ignores it (NaN included).
  if (onednn_product(a, b, out) && bias.dim() <= 2) {
    if (beta != 0) out.copy_(bias.expand_as(out));
    if (onednn_matmul({a, b, out}, beta, alpha)) return;
  }
  at::addmm_out(out, bias, a, b, beta, alpha);
}

void set_onednn_gemm(ffi::PackedArgs args, ffi::Any* rv) {
  check_arity("set_onednn_gemm", args, 1);
  gemm_onednn = AT_MKLDNN_ENABLED() && args[0].cast<bool>();
  *rv = gemm_onednn.load();
}

// "onednn" or "aten": the library that ratex.lib.mm_out, bmm_out and addmm_out (`matmul`
// false) or matmul_out (true) run a @ b -> out on; args (a, b, attrs {"ta", "tb"}, out, matmul).
void gemm_library(ffi::PackedArgs args, ffi::Any* rv) {
  check_arity("gemm_library", args, 5);
  Json cfg = attrs_of(args[2]);
  Operands p{maybe_t(tensor_arg(args, 0), cfg["ta"].as_bool()), maybe_t(tensor_arg(args, 1), cfg["tb"].as_bool()),
             tensor_arg(args, 3)};
  if (args[4].cast<bool>()) p = folded(p.a, p.b, p.out);
  *rv = ffi::String(onednn_product(p.a, p.b, p.out) ? "onednn" : "aten");
}

void convolution(ffi::PackedArgs args, ffi::Any* rv) {
  Json cfg = attrs_of(args[args.size() - 1]);
  bool has_bias = cfg["bias"].as_bool();
  check_arity("convolution", args, has_bias ? 4 : 3);
  std::optional<at::Tensor> bias;
  if (has_bias) bias = tensor_arg(args, 2);
  *rv = to_ffi(at::convolution(tensor_arg(args, 0), tensor_arg(args, 1), bias, cfg["stride"].as_ints(),
                               cfg["padding"].as_ints(), cfg["dilation"].as_ints(), cfg["transposed"].as_bool(),
                               cfg["output_padding"].as_ints(), cfg["groups"].as_int()));
}

void convolution_backward(ffi::PackedArgs args, ffi::Any* rv) {
  check_arity("convolution_backward", args, 4);
  Json cfg = attrs_of(args[3]);
  std::vector<bool> mask = cfg["output_mask"].as_bools();
  if (mask.size() != 3) TVM_FFI_THROW(ValueError) << "convolution_backward: output_mask must have 3 entries";
  std::optional<std::vector<int64_t>> bias_sizes;
  if (!cfg["bias_sizes"].is_null()) bias_sizes = cfg["bias_sizes"].as_ints();
  at::Tensor g = tensor_arg(args, 0);
  auto [gx, gw, gb] = at::convolution_backward(
      g, tensor_arg(args, 1), tensor_arg(args, 2),
      bias_sizes ? at::OptionalIntArrayRef(*bias_sizes) : at::OptionalIntArrayRef(), cfg["stride"].as_ints(),
      cfg["padding"].as_ints(), cfg["dilation"].as_ints(), cfg["transposed"].as_bool(), cfg["output_padding"].as_ints(),
      cfg["groups"].as_int(), {mask[0], mask[1], mask[2]});
  ffi::Array<ffi::Tensor> outs;
  for (const at::Tensor& grad : {gx, gw, gb}) {
    // (an output not asked for: a float32 placeholder, as library.py types it)
    outs.push_back(to_ffi(grad.defined() ? grad : at::zeros({1}, at::TensorOptions().device(g.device()))));
  }
  *rv = outs;
}

void conv2d(ffi::PackedArgs args, ffi::Any* rv) {
  check_arity("conv2d", args, 3);
  Json cfg = attrs_of(args[2]);
  // Relax padding is (top, left, bottom, right); torch's conv takes a symmetric pair.
  std::vector<int64_t> pad = cfg["padding"].as_ints();
  if (pad.size() != 4) TVM_FFI_THROW(ValueError) << "conv2d: padding must have 4 entries";
  at::Tensor x = tensor_arg(args, 0);
  std::vector<int64_t> symmetric = {pad[0], pad[1]};
  if (pad[0] != pad[2] || pad[1] != pad[3]) {
    x = at::constant_pad_nd(x, {pad[1], pad[3], pad[0], pad[2]}, 0);
    symmetric = {0, 0};
  }
  *rv = to_ffi(at::conv2d(x, tensor_arg(args, 1), std::nullopt, cfg["stride"].as_ints(), symmetric,
                          cfg["dilation"].as_ints(), cfg["groups"].as_int()));
}

void conv2d_transpose(ffi::PackedArgs args, ffi::Any* rv) {
  check_arity("conv2d_transpose", args, 3);
  Json cfg = attrs_of(args[2]);
  std::vector<int64_t> pad = cfg["padding"].as_ints();  // the pass only sends symmetric padding here
  *rv = to_ffi(at::conv_transpose2d(tensor_arg(args, 0), tensor_arg(args, 1), std::nullopt, cfg["stride"].as_ints(),
                                    {pad.at(0), pad.at(1)}, cfg["output_padding"].as_ints(), cfg["groups"].as_int(),
                                    cfg["dilation"].as_ints()));
}

void conv2d_weight_grad(ffi::PackedArgs args, ffi::Any* rv) {
  check_arity("conv2d_weight_grad", args, 3);
  Json cfg = attrs_of(args[2]);
  at::Tensor x = tensor_arg(args, 0);
  at::Tensor weight = at::empty(cfg["weight"].as_ints(), x.options());  // only its sizes are read
  auto grads = at::convolution_backward(tensor_arg(args, 1), x, weight, std::nullopt, cfg["stride"].as_ints(),
                                        cfg["padding"].as_ints(), cfg["dilation"].as_ints(), false, {0, 0}, 1,
                                        {false, true, false});
  *rv = to_ffi(std::get<1>(grads));
}

void max_pool2d_backward(ffi::PackedArgs args, ffi::Any* rv) {
  check_arity("max_pool2d_backward", args, 3);
  Json cfg = attrs_of(args[2]);
  at::Tensor x = tensor_arg(args, 1);
  auto kernel = cfg["kernel"].as_ints(), stride = cfg["stride"].as_ints(), padding = cfg["padding"].as_ints(),
       dilation = cfg["dilation"].as_ints();
  bool ceil_mode = cfg["ceil_mode"].as_bool();
  at::Tensor indices = std::get<1>(at::max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode));
  *rv = to_ffi(at::max_pool2d_with_indices_backward(tensor_arg(args, 0), x, kernel, stride, padding, dilation,
                                                    ceil_mode, indices));
}

void avg_pool2d_backward(ffi::PackedArgs args, ffi::Any* rv) {
  check_arity("avg_pool2d_backward", args, 3);
  Json cfg = attrs_of(args[2]);
  *rv = to_ffi(at::avg_pool2d_backward(tensor_arg(args, 0), tensor_arg(args, 1), cfg["kernel"].as_ints(),
                                       cfg["stride"].as_ints(), cfg["padding"].as_ints(), cfg["ceil_mode"].as_bool(),
                                       cfg["count_include_pad"].as_bool(), std::nullopt));
}

// The generic `aten_out` call (tvm_lowering/ops/library.py `_aten`): natively for the ops
// that module sends it, otherwise by the kernel registered before this library loaded.
// Never freed: that is a Python function, which must not be released after Python exits.
ffi::Function* aten_out_fallback = nullptr;

at::ScalarType dtype_named(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "float64") return at::kDouble;
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  TVM_FFI_THROW(ValueError) << "aten_out: unsupported dtype '" << name << "'";
}

void aten_out(ffi::PackedArgs args, ffi::Any* rv) {
  if (args.size() < 3) TVM_FFI_THROW(TypeError) << "ratex.lib.aten_out takes tensors, attributes and an output";
  Json cfg = attrs_of(args[args.size() - 2]);
  const std::string& op = cfg["op"].text;
  const Json& template_args = cfg["args"];
  const Json& kwargs = cfg["kwargs"];
  // Argument `i` of the call (positional, else keyword `name`); tensors by their index.
  auto arg = [&](size_t i, const char* name) -> const Json* {
    if (i < template_args.items.size()) return &template_args.items[i];
    return kwargs.find(name);
  };
  auto tensor = [&](size_t i, const char* name) {
    const Json* a = arg(i, name);
    if (a == nullptr || a->find("tensor") == nullptr) TVM_FFI_THROW(ValueError) << op << ": argument " << name << " is not a tensor";
    int index = static_cast<int>((*a)["tensor"].as_int());
    if (index < 0 || index >= args.size() - 2) TVM_FFI_THROW(ValueError) << op << ": tensor index " << index << " out of range";
    return tensor_arg(args, index);
  };
  auto required = [&](size_t i, const char* name) -> const Json& {
    const Json* a = arg(i, name);
    if (a == nullptr) TVM_FFI_THROW(ValueError) << op << ": missing argument " << name;
    return *a;
  };
  auto approximate = [&](size_t i) {
    const Json* a = arg(i, "approximate");
    return a == nullptr ? std::string("none") : a->text;
  };
  at::Tensor out = tensor_arg(args, args.size() - 1);
  if (op == "aten._softmax.default") {
    at::_softmax_out(out, tensor(0, "self"), required(1, "dim").as_int(), required(2, "half_to_float").as_bool());
  } else if (op == "aten._log_softmax.default") {
    at::_log_softmax_out(out, tensor(0, "self"), required(1, "dim").as_int(), required(2, "half_to_float").as_bool());
  } else if (op == "aten._softmax_backward_data.default") {
    at::_softmax_backward_data_out(out, tensor(0, "grad_output"), tensor(1, "output"), required(2, "dim").as_int(),
                                   dtype_named(required(3, "input_dtype")["dtype"].text));
  } else if (op == "aten._log_softmax_backward_data.default") {
    at::_log_softmax_backward_data_out(out, tensor(0, "grad_output"), tensor(1, "output"), required(2, "dim").as_int(),
                                       dtype_named(required(3, "input_dtype")["dtype"].text));
  } else if (op == "aten.gelu.default") {
    at::gelu_out(out, tensor(0, "self"), approximate(1));
  } else if (op == "aten.gelu_backward.default") {
    at::gelu_backward_out(out, tensor(0, "grad_output"), tensor(1, "self"), approximate(2));
  } else if (op == "aten.embedding_dense_backward.default") {
    at::embedding_dense_backward_out(out, tensor(0, "grad_output"), tensor(1, "indices"),
                                     required(2, "num_weights").as_int(), required(3, "padding_idx").as_int(),
                                     required(4, "scale_grad_by_freq").as_bool());
  } else if (aten_out_fallback != nullptr) {
    aten_out_fallback->CallPacked(args.data(), args.size(), rv);
  } else {
    TVM_FFI_THROW(NotImplementedError) << "ratex.lib.aten_out: no native kernel for " << op;
  }
}

#ifdef RATEX_WITH_CUDA
// The CUDA device of the call's first tensor, or -1 where it has none (a CPU call).
int cuda_device_of(const ffi::PackedArgs& args) {
  for (int i = 0; i < args.size(); ++i) {
    auto dl = args[i].try_cast<DLTensor*>();
    if (dl.has_value()) return (*dl)->device.device_type == kDLCUDA ? (*dl)->device.device_id : -1;
  }
  return -1;
}

// The stream TVM runs the calling program on: the environment stream that tvm-ffi set for
// the call (torch's current stream where the program was given torch tensors), else the
// default stream, which is what TVM launches on when none is set.
c10::cuda::CUDAStream program_stream(int device) {
  auto index = static_cast<c10::DeviceIndex>(device);
  void* stream = TVMFFIEnvGetStream(kDLCUDA, device);
  if (stream == nullptr) return c10::cuda::getDefaultCUDAStream(index);
  return c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), index);
}
#endif

// Runs a kernel with ATen's errors turned into ffi errors (raised in Python as RuntimeError),
// and in inference mode: these tensors never need autograd's bookkeeping. A CUDA call runs
// on the program's device and stream.
template <void (*Kernel)(ffi::PackedArgs, ffi::Any*)>
ffi::Function kernel(const char* name) {
  return ffi::Function::FromPacked([name](ffi::PackedArgs args, ffi::Any* rv) {
    try {
      c10::InferenceMode guard;
#ifdef RATEX_WITH_CUDA
      std::optional<c10::cuda::CUDAStreamGuard> on_stream;
      if (int device = cuda_device_of(args); device >= 0) on_stream.emplace(program_stream(device));
#endif
      Kernel(args, rv);
    } catch (const c10::Error& e) {
      TVM_FFI_THROW(RuntimeError) << "ratex.lib." << name << ": " << e.what_without_backtrace();
    }
  });
}

}  // namespace

// Registers the kernels, replacing the Python ones of the same names (called once by
// ratex/core/kernels.py after it registered those). Returns 0, or -1 with the ffi error set.
extern "C" int RatexRegisterNativeKernels() {
  TVM_FFI_SAFE_CALL_BEGIN();
  if (auto previous = ffi::Function::GetGlobal("ratex.lib.aten_out"); previous && aten_out_fallback == nullptr) {
    aten_out_fallback = new ffi::Function(*previous);
  }
  const std::pair<const char*, ffi::Function> kernels[] = {
      {"mm_out", kernel<product_out<product_into<at::mm_out>>>("mm_out")},
      {"addmm_out", kernel<addmm_out>("addmm_out")},
      {"bmm_out", kernel<product_out<product_into<at::bmm_out>>>("bmm_out")},
      {"matmul_out", kernel<product_out<matmul_into>>("matmul_out")},
      {"set_onednn_gemm", kernel<set_onednn_gemm>("set_onednn_gemm")},
      {"gemm_library", kernel<gemm_library>("gemm_library")},
      {"aten_out", kernel<aten_out>("aten_out")},
      {"convolution", kernel<convolution>("convolution")},
      {"convolution_backward", kernel<convolution_backward>("convolution_backward")},
      {"conv2d", kernel<conv2d>("conv2d")},
      {"conv2d_transpose", kernel<conv2d_transpose>("conv2d_transpose")},
      {"conv2d_weight_grad", kernel<conv2d_weight_grad>("conv2d_weight_grad")},
      {"max_pool2d_backward", kernel<max_pool2d_backward>("max_pool2d_backward")},
      {"avg_pool2d_backward", kernel<avg_pool2d_backward>("avg_pool2d_backward")},
  };
  for (const auto& [name, fn] : kernels) ffi::Function::SetGlobal(std::string("ratex.lib.") + name, fn, true);
  TVM_FFI_SAFE_CALL_END();
}

// The torch version this library was compiled against: a library built for another
// torch must not be loaded (its ATen ABI may differ).
extern "C" const char* RatexNativeTorchVersion() { return RATEX_TORCH_VERSION; }

// 1 where the kernels take CUDA tensors (built against a torch with CUDA), else 0.
extern "C" int RatexNativeCuda() {
#ifdef RATEX_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}
