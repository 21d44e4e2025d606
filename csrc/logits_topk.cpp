// CPU kernel of logits_topk: the k largest logits of selected rows, one pass
// over each row with a small sorted buffer (schema and semantics in ops.cpp).
//
// Order: larger value first; equal values by lower vocabulary index; NaN above
// every number (several NaNs by lower index). Column 0 is therefore exactly
// torch.argmax of the row (and vLLM's greedy sampler), which lets greedy tree
// acceptance reuse the pass the successor-matrix update needs anyway.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace vllm_graft {

// Defined in ops.cpp.
void check_topk_inputs(const at::Tensor& logits, const at::Tensor& rows,
                       int64_t k);

namespace {

// Elements tested together against the buffer's smallest entry: a block whose
// elements are all below it (nearly every block after the first few) costs one
// vectorisable compare-and-or.
constexpr int64_t kBlock = 32;

// Values are compared in float (double for float64 logits): exact for every
// input dtype, so column 0 equals torch.argmax.
template <typename scalar_t>
using compare_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// True when (a, a_index) ranks above (b, b_index) in the op's order.
template <typename value_t>
inline bool ranks_above(value_t a, int64_t a_index, value_t b, int64_t b_index) {
  const bool a_nan = std::isnan(a);
  const bool b_nan = std::isnan(b);
  if (a_nan || b_nan) {
    return a_nan && (!b_nan || a_index < b_index);
  }
  return a > b || (a == b && a_index < b_index);
}

// The k best (value, index) pairs seen so far, best first.
template <typename value_t>
struct TopBuffer {
  value_t* values;
  int64_t* indices;
  int64_t k;
  int64_t count = 0;

  // Elements arrive in increasing index, so a newcomer equal to the k-th entry
  // never displaces it: only strictly better elements (or a NaN over a number)
  // enter a full buffer.
  void offer(value_t value, int64_t index) {
    if (count == k && !ranks_above(value, index, values[k - 1], indices[k - 1])) {
      return;
    }
    int64_t slot = count < k ? count++ : k - 1;
    while (slot > 0 && ranks_above(value, index, values[slot - 1], indices[slot - 1])) {
      values[slot] = values[slot - 1];
      indices[slot] = indices[slot - 1];
      --slot;
    }
    values[slot] = value;
    indices[slot] = index;
  }

  // Whether any element of the block could enter the buffer.
  template <typename scalar_t>
  bool block_may_enter(const scalar_t* block, int64_t length) const {
    if (count < k) return true;
    const value_t threshold = values[k - 1];
    bool hit = false;
    for (int64_t j = 0; j < length; ++j) {
      const value_t value = static_cast<value_t>(block[j]);
      hit |= (value > threshold) | (value != value);
    }
    return hit;
  }
};

template <typename scalar_t>
void row_topk(const scalar_t* row, int64_t vocab_size, int64_t k,
              compare_t<scalar_t>* values, int64_t* out) {
  using value_t = compare_t<scalar_t>;
  TopBuffer<value_t> buffer{values, out, k};
  for (int64_t start = 0; start < vocab_size; start += kBlock) {
    const int64_t length = std::min(kBlock, vocab_size - start);
    if (!buffer.block_may_enter(row + start, length)) continue;
    for (int64_t j = 0; j < length; ++j) {
      buffer.offer(static_cast<value_t>(row[start + j]), start + j);
    }
  }
}

template <typename scalar_t, typename RowT>
void topk_rows(const at::Tensor& logits, const RowT* rows, int64_t num_rows,
               int64_t k, at::Tensor& out) {
  const int64_t vocab_size = logits.size(1);
  const int64_t row_stride = logits.stride(0);
  const scalar_t* data = logits.const_data_ptr<scalar_t>();
  int64_t* out_data = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<compare_t<scalar_t>> values(static_cast<size_t>(k));
    for (int64_t i = begin; i < end; ++i) {
      int64_t* out_row = out_data + i * k;
      const int64_t row = rows == nullptr ? i : static_cast<int64_t>(rows[i]);
      if (row < 0) {
        std::fill(out_row, out_row + k, int64_t{-1});
        continue;
      }
      row_topk<scalar_t>(data + row * row_stride, vocab_size, k, values.data(),
                         out_row);
    }
  });
}

at::Tensor logits_topk_cpu(const at::Tensor& logits, const at::Tensor& rows,
                           int64_t k) {
  check_topk_inputs(logits, rows, k);
  const int64_t num_logits_rows = logits.size(0);
  const at::Tensor row_ids = rows.contiguous();
  const int64_t num_rows = row_ids.size(0);
  at::Tensor out = at::empty({num_rows, k}, logits.options().dtype(at::kLong));
  if (num_rows == 0) return out;

  auto run = [&](auto row_tag) {
    using RowT = decltype(row_tag);
    const RowT* row_data = row_ids.const_data_ptr<RowT>();
    for (int64_t i = 0; i < num_rows; ++i) {
      const int64_t row = static_cast<int64_t>(row_data[i]);
      TORCH_CHECK_VALUE(row >= -1 && row < num_logits_rows, "logits_topk: rows[", i,
                        "] = ", row, " is out of range [-1, ", num_logits_rows, ")");
    }
    switch (logits.scalar_type()) {  // the dtypes check_topk_inputs admits
      case at::kHalf:
        topk_rows<c10::Half, RowT>(logits, row_data, num_rows, k, out);
        break;
      case at::kBFloat16:
        topk_rows<c10::BFloat16, RowT>(logits, row_data, num_rows, k, out);
        break;
      case at::kDouble:
        topk_rows<double, RowT>(logits, row_data, num_rows, k, out);
        break;
      default:
        topk_rows<float, RowT>(logits, row_data, num_rows, k, out);
    }
  };
  if (row_ids.scalar_type() == at::kInt) {
    run(int32_t{});
  } else {
    run(int64_t{});
  }
  return out;
}

}  // namespace
}  // namespace vllm_graft

TORCH_LIBRARY_IMPL(vllm_graft, CPU, m) {
  m.impl("logits_topk", &vllm_graft::logits_topk_cpu);
}
