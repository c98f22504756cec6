// libtorch's flash attention over variable-length sequences (`cum_seq_q/k`), which tch-rs does
// not bind: packed sequences attend within each document without an [s, s] mask. The Rust side
// (ops::flash_varlen) makes the pair an autograd function.
#include "shim.h"
#include "protect.h"

#include <ATen/ATen.h>

#include <tuple>

namespace {

using mrs_detail::protect;

void check_packed(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 3, what, " must be [tokens, heads, head_dim], got ", t.dim(),
              " dimensions");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, what,
              " must be bf16 or fp16 for flash attention");
}

void check_offsets(const at::Tensor& cu_seqlens) {
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.scalar_type() == at::kInt,
              "cu_seqlens must be a 1-D int32 tensor");
  TORCH_CHECK(cu_seqlens.size(0) >= 2, "cu_seqlens needs at least one document");
}

}  // namespace

extern "C" {

char* mrs_flash_varlen_forward(const mrs_tensor query, const mrs_tensor key,
                               const mrs_tensor value, const mrs_tensor cu_seqlens,
                               int64_t max_seqlen, double dropout, int causal, mrs_tensor* out,
                               mrs_tensor* logsumexp_out, mrs_tensor* rng_state_out,
                               mrs_tensor* unused_out) {
  return protect([&] {
    const at::Tensor& q = *query;
    check_packed(q, "the query");
    check_packed(*key, "the key");
    check_packed(*value, "the value");
    check_offsets(*cu_seqlens);
    auto [output, logsumexp, rng_state, unused, debug] = at::_flash_attention_forward(
        q, *key, *value, *cu_seqlens, *cu_seqlens, max_seqlen, max_seqlen, dropout, causal != 0,
        false);
    *out = new at::Tensor(output);
    *logsumexp_out = new at::Tensor(logsumexp);
    *rng_state_out = new at::Tensor(rng_state);
    *unused_out = new at::Tensor(unused);
  });
}

char* mrs_flash_varlen_backward(const mrs_tensor grad_out, const mrs_tensor query,
                                const mrs_tensor key, const mrs_tensor value,
                                const mrs_tensor out, const mrs_tensor logsumexp,
                                const mrs_tensor cu_seqlens, int64_t max_seqlen, double dropout,
                                int causal, const mrs_tensor rng_state, const mrs_tensor unused,
                                mrs_tensor* grad_query, mrs_tensor* grad_key,
                                mrs_tensor* grad_value) {
  return protect([&] {
    auto [dq, dk, dv] = at::_flash_attention_backward(
        (*grad_out).contiguous(), *query, *key, *value, *out, *logsumexp, *cu_seqlens,
        *cu_seqlens, max_seqlen, max_seqlen, dropout, causal != 0, *rng_state, *unused);
    *grad_query = new at::Tensor(dq);
    *grad_key = new at::Tensor(dk);
    *grad_value = new at::Tensor(dv);
  });
}

}  // extern "C"
