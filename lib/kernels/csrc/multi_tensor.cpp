// Multi-tensor ("foreach") kernels and the fused AdamW step that tch-rs does not bind: the
// optimizer and gradient clipping launch one kernel per tensor list instead of one per tensor.
#include "shim.h"
#include "protect.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using mrs_detail::protect;

std::vector<at::Tensor> tensors_of(const mrs_tensor* handles, size_t n) {
  std::vector<at::Tensor> tensors;
  tensors.reserve(n);
  for (size_t i = 0; i < n; ++i) tensors.push_back(*handles[i]);
  return tensors;
}

}  // namespace

extern "C" {

char* mrs_fused_adamw(const mrs_tensor* params, const mrs_tensor* grads,
                      const mrs_tensor* exp_avgs, const mrs_tensor* exp_avg_sqs,
                      const mrs_tensor* steps, size_t n, double lr, double beta1, double beta2,
                      double weight_decay, double eps, const mrs_tensor grad_divisor) {
  return protect([&] {
    if (n == 0) return;
    auto step_list = tensors_of(steps, n);
    at::_foreach_add_(step_list, 1);
    std::optional<at::Tensor> divisor;
    if (grad_divisor != nullptr) divisor = *grad_divisor;
    at::_fused_adamw_(tensors_of(params, n), tensors_of(grads, n), tensors_of(exp_avgs, n),
                      tensors_of(exp_avg_sqs, n), {}, step_list, lr, beta1, beta2, weight_decay,
                      eps, /*amsgrad=*/false, /*maximize=*/false, divisor, std::nullopt);
  });
}

char* mrs_foreach_total_norm(const mrs_tensor* tensors, size_t n, mrs_tensor* norm_out) {
  return protect([&] {
    auto list = tensors_of(tensors, n);
    auto norms = at::_foreach_norm(list, 2);
    auto squares = at::stack(norms).to(at::kFloat).pow(2).sum();
    *norm_out = new at::Tensor(squares.sqrt());
  });
}

char* mrs_foreach_mul_(const mrs_tensor* tensors, size_t n, const mrs_tensor factor) {
  return protect([&] {
    auto list = tensors_of(tensors, n);
    at::_foreach_mul_(list, *factor);
  });
}

char* mrs_foreach_add_(const mrs_tensor* targets, const mrs_tensor* sources, size_t n) {
  return protect([&] {
    auto target_list = tensors_of(targets, n);
    at::_foreach_add_(target_list, tensors_of(sources, n));
  });
}

char* mrs_foreach_copy_(const mrs_tensor* targets, const mrs_tensor* sources, size_t n) {
  return protect([&] {
    auto target_list = tensors_of(targets, n);
    at::_foreach_copy_(target_list, tensors_of(sources, n));
  });
}

char* mrs_foreach_zero_(const mrs_tensor* tensors, size_t n) {
  return protect([&] {
    auto list = tensors_of(tensors, n);
    at::_foreach_zero_(list);
  });
}

char* mrs_unscale_and_check_finite(const mrs_tensor* tensors, size_t n, const mrs_tensor found_inf,
                                   const mrs_tensor inv_scale) {
  return protect([&] {
    auto list = tensors_of(tensors, n);
    auto found = *found_inf;
    at::_amp_foreach_non_finite_check_and_unscale_(list, found, *inv_scale);
  });
}

char* mrs_set_deterministic(int enabled) {
  return protect([&] {
    at::globalContext().setDeterministicAlgorithms(enabled != 0, /*warn_only=*/false);
    at::globalContext().setDeterministicCuDNN(enabled != 0);
    at::globalContext().setBenchmarkCuDNN(false);
  });
}

}  // extern "C"
