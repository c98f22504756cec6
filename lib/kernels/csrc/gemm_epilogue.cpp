// The MLP's fc1 GEMM with the bias and tanh-GeLU in its cuBLASLt epilogue, which ATen does not
// expose: one GEMM writes GeLU(x·Wᵀ + b) and, as its auxiliary output, the argument x·Wᵀ + b
// that GeLU's gradient needs (CUBLASLT_EPILOGUE_GELU_AUX_BIAS), replacing the GeLU kernel
// (Megatron's bias_gelu fusion, tanh approximation).
//
// The cuBLASLt entry points are looked up at run time in the libcublasLt that libtorch_cuda
// loaded, so the build needs no CUDA library to link against. Compiled with MRS_CUDA_GRAPHS (the
// CUDA runtime headers were found); otherwise every entry point reports the epilogues
// unavailable.
#include "shim.h"
#include "protect.h"

using mrs_detail::protect;

#ifdef MRS_CUDA_GRAPHS

#include <ATen/ATen.h>
#include <dlfcn.h>

#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

namespace {

// The part of cuBLASLt's C ABI used here (cublasLt.h, CUDA 13), declared here because
// cublas_api.h includes cuda_fp16.h, which needs CCCL headers the CUDA wheels do not ship.
// These types and values are part of cuBLASLt's stable interface.
using cublasStatus_t = int;
constexpr cublasStatus_t CUBLAS_STATUS_SUCCESS = 0;
using cudaDataType_t = int;
constexpr cudaDataType_t CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14;
constexpr int CUBLAS_COMPUTE_32F = 68;
using cublasOperation_t = int;
constexpr cublasOperation_t CUBLAS_OP_N = 0, CUBLAS_OP_T = 1;
using cublasLtEpilogue_t = uint32_t;
constexpr cublasLtEpilogue_t CUBLASLT_EPILOGUE_GELU_AUX_BIAS = 32 | 128 | 4;
// cublasLtMatmulDescAttributes_t
constexpr int DESC_TRANSA = 3, DESC_TRANSB = 4, DESC_EPILOGUE = 7, DESC_BIAS_POINTER = 8,
              DESC_EPILOGUE_AUX_POINTER = 11, DESC_EPILOGUE_AUX_LD = 12, DESC_BIAS_DATA_TYPE = 26;
// cublasLtMatmulPreferenceAttributes_t
constexpr int PREF_MAX_WORKSPACE_BYTES = 1, PREF_MIN_ALIGNMENT_A_BYTES = 5,
              PREF_MIN_ALIGNMENT_B_BYTES = 6, PREF_MIN_ALIGNMENT_C_BYTES = 7,
              PREF_MIN_ALIGNMENT_D_BYTES = 8;
using cublasLtHandle_t = void*;
using cublasLtMatmulDesc_t = void*;
using cublasLtMatrixLayout_t = void*;
using cublasLtMatmulPreference_t = void*;
struct cublasLtMatmulAlgo_t {
  uint64_t data[8];
};
struct cublasLtMatmulHeuristicResult_t {
  cublasLtMatmulAlgo_t algo;
  size_t workspaceSize;
  cublasStatus_t state;
  float wavesCount;
  int reserved[4];
};

// The cuBLASLt functions used here, resolved once from the loaded library.
struct Lt {
  cublasStatus_t (*create)(cublasLtHandle_t*);
  cublasStatus_t (*desc_create)(cublasLtMatmulDesc_t*, int compute, cudaDataType_t scale);
  cublasStatus_t (*desc_destroy)(cublasLtMatmulDesc_t);
  cublasStatus_t (*desc_set)(cublasLtMatmulDesc_t, int attribute, const void*, size_t);
  cublasStatus_t (*layout_create)(cublasLtMatrixLayout_t*, cudaDataType_t, uint64_t rows,
                                  uint64_t cols, int64_t ld);
  cublasStatus_t (*layout_destroy)(cublasLtMatrixLayout_t);
  cublasStatus_t (*preference_create)(cublasLtMatmulPreference_t*);
  cublasStatus_t (*preference_destroy)(cublasLtMatmulPreference_t);
  cublasStatus_t (*preference_set)(cublasLtMatmulPreference_t, int attribute, const void*,
                                   size_t);
  cublasStatus_t (*heuristic)(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t,
                              cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                              cublasLtMatrixLayout_t, cublasLtMatmulPreference_t, int requested,
                              cublasLtMatmulHeuristicResult_t* results, int* returned);
  cublasStatus_t (*matmul)(cublasLtHandle_t, cublasLtMatmulDesc_t, const void* alpha,
                           const void* a, cublasLtMatrixLayout_t, const void* b,
                           cublasLtMatrixLayout_t, const void* beta, const void* c,
                           cublasLtMatrixLayout_t, void* d, cublasLtMatrixLayout_t,
                           const cublasLtMatmulAlgo_t* algo, void* workspace,
                           size_t workspace_size, void* stream);
};

template <typename F>
F resolve(void* library, const char* name) {
  void* symbol = dlsym(library, name);
  if (symbol == nullptr) {
    throw std::runtime_error(std::string("cuBLASLt has no ") + name);
  }
  return reinterpret_cast<F>(symbol);
}

const Lt& lt() {
  static const Lt functions = [] {
    // libtorch_cuda depends on libcublasLt, so it is loaded whenever CUDA tensors exist.
    void* library = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_NOLOAD);
    if (library == nullptr) library = RTLD_DEFAULT;
    Lt f;
    f.create = resolve<decltype(f.create)>(library, "cublasLtCreate");
    f.desc_create = resolve<decltype(f.desc_create)>(library, "cublasLtMatmulDescCreate");
    f.desc_destroy = resolve<decltype(f.desc_destroy)>(library, "cublasLtMatmulDescDestroy");
    f.desc_set = resolve<decltype(f.desc_set)>(library, "cublasLtMatmulDescSetAttribute");
    f.layout_create = resolve<decltype(f.layout_create)>(library, "cublasLtMatrixLayoutCreate");
    f.layout_destroy = resolve<decltype(f.layout_destroy)>(library, "cublasLtMatrixLayoutDestroy");
    f.preference_create =
        resolve<decltype(f.preference_create)>(library, "cublasLtMatmulPreferenceCreate");
    f.preference_destroy =
        resolve<decltype(f.preference_destroy)>(library, "cublasLtMatmulPreferenceDestroy");
    f.preference_set =
        resolve<decltype(f.preference_set)>(library, "cublasLtMatmulPreferenceSetAttribute");
    f.heuristic = resolve<decltype(f.heuristic)>(library, "cublasLtMatmulAlgoGetHeuristic");
    f.matmul = resolve<decltype(f.matmul)>(library, "cublasLtMatmul");
    return f;
  }();
  return functions;
}

// Hopper's GEMM kernels ask for up to 32 MiB of workspace.
constexpr size_t kWorkspaceBytes = 32u << 20;

void ok(cublasStatus_t status, const char* what);

// One cuBLASLt handle for the process (a light handle, not tied to a device or stream).
cublasLtHandle_t lt_handle() {
  static cublasLtHandle_t handle = [] {
    cublasLtHandle_t created = nullptr;
    ok(lt().create(&created), "handle creation");
    return created;
  }();
  return handle;
}

void ok(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("cuBLASLt ") + what + " failed with status " +
                             std::to_string(static_cast<int>(status)));
  }
}

cudaDataType_t data_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16:
      return CUDA_R_16BF;
    case at::kHalf:
      return CUDA_R_16F;
    default:
      throw std::runtime_error("the GeLU GEMM epilogue takes bf16 or fp16 tensors, not " +
                               std::string(c10::toString(t.scalar_type())));
  }
}

// cuBLASLt reads and writes these with 16-byte accesses.
void check_operand(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.is_cuda(), name, " is not on a CUDA device");
  TORCH_CHECK(t.dim() == dims, name, " has ", t.dim(), " dimensions, not ", dims);
  TORCH_CHECK(t.is_contiguous(), name, " is not contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " is not 16-byte aligned");
  TORCH_CHECK(t.size(-1) % 8 == 0, name, "'s last dimension ", t.size(-1),
              " is not a multiple of 8");
}

// Owns the descriptors of one call.
struct Call {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~Call() {
    const Lt& f = lt();
    if (preference) f.preference_destroy(preference);
    if (d) f.layout_destroy(d);
    if (b) f.layout_destroy(b);
    if (a) f.layout_destroy(a);
    if (op) f.desc_destroy(op);
  }
};

// The largest power of two up to 256 dividing the address: cuBLASLt assumes 256-byte aligned
// operands unless told, and parameters in the flat buffers are only 128-byte aligned.
uint32_t alignment(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  uint32_t bytes = 256;
  while (bytes > 16 && address % bytes != 0) bytes /= 2;
  return bytes;
}

// The heuristic's first algorithm per problem; asking costs tens of microseconds of host time.
using ProblemKey = std::tuple<int, int, int, int64_t, int64_t, int64_t, int, int, uint32_t,
                              uint32_t, uint32_t>;
std::map<ProblemKey, cublasLtMatmulHeuristicResult_t>& algorithms() {
  static std::map<ProblemKey, cublasLtMatmulHeuristicResult_t> cache;
  return cache;
}
std::mutex algorithms_mutex;

// D (column-major m×n, ld m) = epilogue(op(A) · op(B)), with A stored column-major as
// (transa ? k×m : m×k) and B as k×n; `bias` and `aux` as the epilogue wants them.
void matmul(const at::Tensor& a, bool transa, const at::Tensor& b, const at::Tensor& d, int64_t m,
            int64_t n, int64_t k, cublasLtEpilogue_t epilogue, void* bias, cudaDataType_t bias_type,
            void* aux) {
  const Lt& f = lt();
  const cudaDataType_t type = data_type(d);
  Call call;
  ok(f.desc_create(&call.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "descriptor");
  const cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = CUBLAS_OP_N;
  ok(f.desc_set(call.op, DESC_TRANSA, &ta, sizeof(ta)), "transa");
  ok(f.desc_set(call.op, DESC_TRANSB, &tb, sizeof(tb)), "transb");
  ok(f.desc_set(call.op, DESC_EPILOGUE, &epilogue, sizeof(epilogue)), "epilogue");
  ok(f.desc_set(call.op, DESC_BIAS_POINTER, &bias, sizeof(bias)), "bias");
  ok(f.desc_set(call.op, DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)),
     "bias type");
  const int64_t aux_ld = m;
  ok(f.desc_set(call.op, DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)), "aux");
  ok(f.desc_set(call.op, DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)),
     "aux leading dimension");
  ok(f.layout_create(&call.a, type, transa ? k : m, transa ? m : k, transa ? k : m), "layout A");
  ok(f.layout_create(&call.b, type, k, n, k), "layout B");
  ok(f.layout_create(&call.d, type, m, n, m), "layout D");

  // From the caching allocator on the current stream, so it is reused in stream order (and
  // comes from a graph's pool under capture).
  const size_t workspace_size = kWorkspaceBytes;
  at::Tensor workspace_tensor =
      at::empty({static_cast<int64_t>(workspace_size)}, d.options().dtype(at::kByte));
  void* workspace = workspace_tensor.data_ptr();
  cublasLtHandle_t handle = lt_handle();
  cublasLtMatmulHeuristicResult_t result{};
  const uint32_t align_a = alignment(a.data_ptr()), align_b = alignment(b.data_ptr()),
                 align_d = alignment(d.data_ptr());
  const ProblemKey key{static_cast<int>(type), static_cast<int>(epilogue), transa, m, n, k,
                       static_cast<int>(bias_type), d.get_device(), align_a, align_b, align_d};
  {
    std::lock_guard<std::mutex> lock(algorithms_mutex);
    auto found = algorithms().find(key);
    if (found != algorithms().end()) {
      result = found->second;
    } else {
      ok(f.preference_create(&call.preference), "preference");
      ok(f.preference_set(call.preference, PREF_MAX_WORKSPACE_BYTES,
                          &workspace_size, sizeof(workspace_size)),
         "workspace preference");
      // C is D (beta is zero, and D is passed for it).
      const std::pair<int, const uint32_t*> alignments[] = {
          {PREF_MIN_ALIGNMENT_A_BYTES, &align_a},
          {PREF_MIN_ALIGNMENT_B_BYTES, &align_b},
          {PREF_MIN_ALIGNMENT_C_BYTES, &align_d},
          {PREF_MIN_ALIGNMENT_D_BYTES, &align_d},
      };
      for (const auto& [attribute, bytes] : alignments) {
        ok(f.preference_set(call.preference, attribute, bytes, sizeof(*bytes)),
           "alignment preference");
      }
      int returned = 0;
      ok(f.heuristic(handle, call.op, call.a, call.b, call.d, call.d, call.preference, 1, &result,
                     &returned),
         "heuristic");
      if (returned == 0) {
        throw std::runtime_error("cuBLASLt has no algorithm for this GeLU GEMM epilogue");
      }
      algorithms().emplace(key, result);
    }
  }
  const float alpha = 1.0f, beta = 0.0f;
  void* stream = nullptr;
  if (char* error = mrs_current_stream(d.get_device(), &stream)) {
    const std::string message(error);
    mrs_free_string(error);
    throw std::runtime_error(message);
  }
  ok(f.matmul(handle, call.op, &alpha, a.data_ptr(), call.a, b.data_ptr(), call.b, &beta,
              d.data_ptr(), call.d, d.data_ptr(), call.d, &result.algo, workspace, workspace_size,
              stream),
     "matmul");
}

}  // namespace

extern "C" {

int mrs_gemm_epilogues_available(void) { return 1; }

char* mrs_linear_gelu_aux(const mrs_tensor input, const mrs_tensor weight, const mrs_tensor bias,
                          mrs_tensor* out, mrs_tensor* preactivation_out) {
  return protect([&] {
    const at::Tensor& x = *input;
    const at::Tensor& w = *weight;
    const at::Tensor& b = *bias;
    check_operand(x, "the input", 2);
    check_operand(w, "the weight", 2);
    TORCH_CHECK(b.is_contiguous() && b.dim() == 1 && b.size(0) == w.size(0),
                "the bias does not match the weight's ", w.size(0), " rows");
    TORCH_CHECK(x.scalar_type() == w.scalar_type() && b.scalar_type() == w.scalar_type(),
                "input, weight and bias differ in dtype");
    TORCH_CHECK(x.size(1) == w.size(1), "input width ", x.size(1), " is not the weight's ",
                w.size(1));
    const int64_t rows = x.size(0), features = w.size(0), inner = w.size(1);
    TORCH_CHECK(features % 8 == 0, "the output width ", features, " is not a multiple of 8");
    at::Tensor y = at::empty({rows, features}, x.options());
    at::Tensor pre = at::empty({rows, features}, x.options());
    // Row-major y = x·Wᵀ is column-major yᵀ = W·xᵀ: A = W (stored k×m, transposed), B = xᵀ.
    matmul(w, true, x, y, features, rows, inner, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, b.data_ptr(),
           data_type(b), pre.data_ptr());
    *out = new at::Tensor(y);
    *preactivation_out = new at::Tensor(pre);
  });
}

}  // extern "C"

#else

#include <stdexcept>

namespace {

char* unavailable() {
  return protect([] {
    throw std::runtime_error(
        "this build of megatron-rs has no cuBLASLt GeLU epilogue: its build found no CUDA runtime "
        "headers beside a CUDA libtorch");
  });
}

}  // namespace

extern "C" {

int mrs_gemm_epilogues_available(void) { return 0; }

char* mrs_linear_gelu_aux(const mrs_tensor, const mrs_tensor, const mrs_tensor, mrs_tensor*,
                          mrs_tensor*) {
  return unavailable();
}

}  // extern "C"

#endif
