// CUDA bindings of the successor-matrix ops (schemas live in ops.cpp).
//
// Ids are not range-checked here: that would need a device sync on every call
// and break CUDA graph capture. The Python facade checks them when asked
// (check=True); the kernels never access memory outside the matrix either way.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include "kernels/successor_kernels.cuh"
#include "kernels/topk_kernels.cuh"

namespace vllm_graft {

// Defined in ops.cpp: shape, dtype and device checks shared by all backends.
void check_gather_inputs(const at::Tensor& successors,
                         const at::Tensor& parent_tokens,
                         const at::Tensor& ranks);
void check_update_inputs(const at::Tensor& successors,
                         const at::Tensor& tokens,
                         const at::Tensor& next_tokens);
void check_topk_inputs(const at::Tensor& logits, const at::Tensor& rows,
                       int64_t k);

namespace {

void check_launch(const char* op, cudaError_t status) {
  TORCH_CHECK(status == cudaSuccess, op, ": CUDA kernel launch failed: ",
              cudaGetErrorString(status));
}

template <typename IndexT>
cudaError_t launch_gather_for(const at::Tensor& successors,
                              const at::Tensor& parents,
                              const at::Tensor& ranks, at::Tensor& out,
                              cudaStream_t stream) {
  return launch_successor_gather<IndexT>(
      successors.const_data_ptr<int32_t>(), successors.size(0),
      successors.size(1), parents.const_data_ptr<IndexT>(),
      ranks.const_data_ptr<IndexT>(), out.mutable_data_ptr<int32_t>(),
      parents.size(0), stream);
}

at::Tensor successor_gather_cuda(const at::Tensor& successors,
                                 const at::Tensor& parent_tokens,
                                 const at::Tensor& ranks) {
  check_gather_inputs(successors, parent_tokens, ranks);
  const c10::cuda::CUDAGuard device_guard(successors.device());
  const at::Tensor parents = parent_tokens.contiguous();
  const at::Tensor parent_ranks = ranks.contiguous();
  at::Tensor out = at::empty({parents.size(0)}, successors.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  const cudaError_t status =
      parents.scalar_type() == at::kInt
          ? launch_gather_for<int32_t>(successors, parents, parent_ranks, out,
                                       stream)
          : launch_gather_for<int64_t>(successors, parents, parent_ranks, out,
                                       stream);
  check_launch("successor_gather", status);
  return out;
}

template <typename TokenT, typename NextTokenT>
cudaError_t launch_update_for(at::Tensor& successors, const at::Tensor& tokens,
                              const at::Tensor& next_tokens,
                              cudaStream_t stream) {
  return launch_successor_update<TokenT, NextTokenT>(
      successors.mutable_data_ptr<int32_t>(), successors.size(0),
      successors.size(1), tokens.const_data_ptr<TokenT>(),
      next_tokens.const_data_ptr<NextTokenT>(), tokens.size(0), stream);
}

void successor_update_cuda(at::Tensor& successors, const at::Tensor& tokens,
                           const at::Tensor& next_tokens) {
  check_update_inputs(successors, tokens, next_tokens);
  const c10::cuda::CUDAGuard device_guard(successors.device());
  const at::Tensor node_tokens = tokens.contiguous();
  const at::Tensor node_next_tokens = next_tokens.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  const bool tokens_int32 = node_tokens.scalar_type() == at::kInt;
  const bool next_int32 = node_next_tokens.scalar_type() == at::kInt;
  cudaError_t status;
  if (tokens_int32 && next_int32) {
    status = launch_update_for<int32_t, int32_t>(successors, node_tokens,
                                                 node_next_tokens, stream);
  } else if (tokens_int32) {
    status = launch_update_for<int32_t, int64_t>(successors, node_tokens,
                                                 node_next_tokens, stream);
  } else if (next_int32) {
    status = launch_update_for<int64_t, int32_t>(successors, node_tokens,
                                                 node_next_tokens, stream);
  } else {
    status = launch_update_for<int64_t, int64_t>(successors, node_tokens,
                                                 node_next_tokens, stream);
  }
  check_launch("successor_update_", status);
}

template <typename ScalarT, typename RowT>
cudaError_t launch_topk_for(const at::Tensor& logits, const at::Tensor& rows,
                            int64_t k, at::Tensor& out, cudaStream_t stream) {
  const int64_t num_rows = rows.size(0);
  const int64_t vocab_size = logits.size(1);
  int64_t splits = 1;  // from shapes and the SM count only: no device sync
  if (num_rows > 0) {
    const cudaError_t status = logits_topk_splits(num_rows, vocab_size, &splits);
    if (status != cudaSuccess) return status;
  }
  // Split rows: each slice's top-k ([rows, splits, k] values and ids), and one
  // ticket per row, zeroed here and left zeroed by the kernel.
  using ValueT = typename LogitsTopkValue<ScalarT>::type;
  at::Tensor split_values, split_indices, tickets;
  if (splits > 1) {
    split_values = at::empty({num_rows, splits, k},
                             logits.options().dtype(c10::CppTypeToScalarType<ValueT>::value));
    split_indices = at::empty({num_rows, splits, k}, logits.options().dtype(at::kLong));
    tickets = at::zeros({num_rows}, logits.options().dtype(at::kInt));
  }
  // at::Half / at::BFloat16 share the bit layout of __half / __nv_bfloat16
  return launch_logits_topk<ScalarT, RowT>(
      reinterpret_cast<const ScalarT*>(logits.const_data_ptr()), logits.size(0),
      vocab_size, logits.stride(0), rows.const_data_ptr<RowT>(), num_rows, k, splits,
      splits > 1 ? split_values.mutable_data_ptr<ValueT>() : nullptr,
      splits > 1 ? split_indices.mutable_data_ptr<int64_t>() : nullptr,
      splits > 1 ? reinterpret_cast<unsigned int*>(tickets.mutable_data_ptr<int32_t>())
                 : nullptr,
      out.mutable_data_ptr<int64_t>(), stream);
}

template <typename RowT>
cudaError_t launch_topk_rows(const at::Tensor& logits, const at::Tensor& rows,
                             int64_t k, at::Tensor& out, cudaStream_t stream) {
  switch (logits.scalar_type()) {  // the dtypes check_topk_inputs admits
    case at::kHalf:
      return launch_topk_for<__half, RowT>(logits, rows, k, out, stream);
    case at::kBFloat16:
      return launch_topk_for<__nv_bfloat16, RowT>(logits, rows, k, out, stream);
    case at::kDouble:
      return launch_topk_for<double, RowT>(logits, rows, k, out, stream);
    default:
      return launch_topk_for<float, RowT>(logits, rows, k, out, stream);
  }
}

at::Tensor logits_topk_cuda(const at::Tensor& logits, const at::Tensor& rows,
                            int64_t k) {
  check_topk_inputs(logits, rows, k);
  const c10::cuda::CUDAGuard device_guard(logits.device());
  const at::Tensor row_ids = rows.contiguous();
  at::Tensor out = at::empty({row_ids.size(0), k}, logits.options().dtype(at::kLong));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t status =
      row_ids.scalar_type() == at::kInt
          ? launch_topk_rows<int32_t>(logits, row_ids, k, out, stream)
          : launch_topk_rows<int64_t>(logits, row_ids, k, out, stream);
  check_launch("logits_topk", status);
  return out;
}

}  // namespace
}  // namespace vllm_graft

TORCH_LIBRARY_IMPL(vllm_graft, CUDA, m) {
  m.impl("successor_gather", &vllm_graft::successor_gather_cuda);
  m.impl("successor_update_", &vllm_graft::successor_update_cuda);
  m.impl("logits_topk", &vllm_graft::logits_topk_cuda);
}
