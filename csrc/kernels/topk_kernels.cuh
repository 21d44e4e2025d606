// CUDA kernel of logits_topk: the k largest logits of selected rows, best
// first (larger value, then lower index; NaN above every number), so column 0
// is torch.argmax of the row. Torch-free like successor_kernels.cuh; bound to
// torch in ops_cuda.cpp.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace vllm_graft {

// Largest k the kernel supports (each thread keeps k candidates).
constexpr int kMaxLogitsTopk = 64;

// out[i, :] = top-k indices of logits[rows[i], :] (row stride row_stride
// elements, unit stride along the vocabulary); rows[i] < 0 or >= num_logits_rows
// gives a row of -1, so a bad row id never reads outside the logits. One block
// per output row, one pass over the row. ScalarT: float, __half,
// __nv_bfloat16 or double; RowT: int32_t or int64_t. 1 <= k <= kMaxLogitsTopk.
template <typename ScalarT, typename RowT>
cudaError_t launch_logits_topk(const ScalarT* logits, int64_t num_logits_rows,
                               int64_t vocab_size, int64_t row_stride,
                               const RowT* rows, int64_t num_rows, int64_t k,
                               int64_t* out, cudaStream_t stream);

}  // namespace vllm_graft
