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

// Splitting a row across blocks, when there are too few rows to fill the GPU:
// about kLogitsTopkBlocksPerSm blocks per SM in all, slices of at least
// kMinLogitsTopkSlice logits, a multiple of kLogitsTopkSliceAlign long (the
// block size), at most kMaxLogitsTopkSplits slices per row (one merging thread
// each).
constexpr int64_t kLogitsTopkBlocksPerSm = 4;
constexpr int64_t kMinLogitsTopkSlice = 4096;
constexpr int64_t kLogitsTopkSliceAlign = 256;
constexpr int64_t kMaxLogitsTopkSplits = 64;

// Slice length when each row is cut into `splits` slices: ceil(vocab / splits)
// rounded up to kLogitsTopkSliceAlign; 1 split reads the whole row.
inline int64_t logits_topk_slice_length(int64_t vocab_size, int64_t splits) {
  if (splits <= 1) return vocab_size;
  const int64_t even = (vocab_size + splits - 1) / splits;
  return (even + kLogitsTopkSliceAlign - 1) / kLogitsTopkSliceAlign * kLogitsTopkSliceAlign;
}

// Slices per row for num_rows rows on sm_count SMs, from shapes only: enough
// blocks for kLogitsTopkBlocksPerSm per SM, no slice shorter than
// kMinLogitsTopkSlice, and no empty slice; 1 when the rows alone fill the GPU.
// tests/ops/test_logits_topk.py mirrors this rule from the constants above.
inline int64_t logits_topk_split_count(int64_t num_rows, int64_t vocab_size,
                                       int64_t sm_count) {
  if (num_rows < 1 || sm_count < 1) return 1;
  int64_t splits = (kLogitsTopkBlocksPerSm * sm_count + num_rows - 1) / num_rows;
  const int64_t longest = vocab_size / kMinLogitsTopkSlice;
  if (splits > longest) splits = longest;
  if (splits > kMaxLogitsTopkSplits) splits = kMaxLogitsTopkSplits;
  if (splits <= 1) return 1;
  const int64_t slice = logits_topk_slice_length(vocab_size, splits);
  return (vocab_size + slice - 1) / slice;  // rounding up the slices may leave fewer
}

// logits_topk_split_count on the current device.
cudaError_t logits_topk_splits(int64_t num_rows, int64_t vocab_size, int64_t* splits);

// Candidate values in the split workspace: float, double for float64 logits.
template <typename ScalarT> struct LogitsTopkValue { using type = float; };
template <> struct LogitsTopkValue<double> { using type = double; };

// out[i, :] = top-k indices of logits[rows[i], :] (row stride row_stride
// elements, unit stride along the vocabulary); rows[i] < 0 or >= num_logits_rows
// gives a row of -1, so a bad row id never reads outside the logits. ScalarT:
// float, __half, __nv_bfloat16 or double; RowT: int32_t or int64_t.
// 1 <= k <= kMaxLogitsTopk; 1 <= splits <= kMaxLogitsTopkSplits.
//
// splits == 1: one block per output row, one pass over the row; the workspace
// pointers are unused (may be null). splits > 1: grid (rows, splits), each
// block takes the top-k of one slice of the row into split_values /
// split_indices ([num_rows, splits, k] each, uninitialised), and the last block
// of a row to finish merges them into out. tickets: num_rows zeros, left zero.
template <typename ScalarT, typename RowT>
cudaError_t launch_logits_topk(const ScalarT* logits, int64_t num_logits_rows,
                               int64_t vocab_size, int64_t row_stride,
                               const RowT* rows, int64_t num_rows, int64_t k,
                               int64_t splits,
                               typename LogitsTopkValue<ScalarT>::type* split_values,
                               int64_t* split_indices, unsigned int* tickets,
                               int64_t* out, cudaStream_t stream);

}  // namespace vllm_graft
