#include "topk_kernels.cuh"

namespace vllm_graft {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Values are compared in float (double for float64 logits): exact for every
// input dtype, so column 0 equals torch.argmax.
template <typename ScalarT> struct Compare { using type = float; };
template <> struct Compare<double> { using type = double; };

__device__ __forceinline__ float to_compare(float x) { return x; }
__device__ __forceinline__ double to_compare(double x) { return x; }
__device__ __forceinline__ float to_compare(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_compare(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// (value, index) in the op's order; index -1 marks "no candidate", below all.
template <typename ValueT>
struct Candidate {
  ValueT value;
  int64_t index;
};

template <typename ValueT>
__device__ __forceinline__ bool ranks_above(const Candidate<ValueT>& a,
                                            const Candidate<ValueT>& b) {
  if (a.index < 0) return false;
  if (b.index < 0) return true;
  const bool a_nan = isnan(a.value);
  const bool b_nan = isnan(b.value);
  if (a_nan || b_nan) return a_nan && (!b_nan || a.index < b.index);
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

template <typename ValueT>
__device__ __forceinline__ Candidate<ValueT> better(const Candidate<ValueT>& a,
                                                    const Candidate<ValueT>& b) {
  return ranks_above(b, a) ? b : a;
}

template <typename ValueT>
__device__ Candidate<ValueT> warp_best(Candidate<ValueT> c) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    Candidate<ValueT> other;
    other.value = __shfl_down_sync(0xffffffffu, c.value, offset);
    other.index = __shfl_down_sync(0xffffffffu, c.index, offset);
    c = better(c, other);
  }
  return c;
}

// Each thread scans a strided slice of the row keeping its own sorted top-k
// (coalesced reads: neighbouring threads read neighbouring logits); then k
// rounds of a block-wide arg-best over the threads' heads pick the row's top-k
// in order. Vocabulary indices are unique across threads, so exactly one thread
// advances per round.
template <typename ScalarT, typename RowT>
__global__ void logits_topk_kernel(const ScalarT* __restrict__ logits,
                                   int64_t num_logits_rows, int64_t vocab_size,
                                   int64_t row_stride, const RowT* __restrict__ rows,
                                   int64_t num_rows, int k, int64_t* __restrict__ out) {
  using ValueT = typename Compare<ScalarT>::type;
  using Cand = Candidate<ValueT>;
  __shared__ Cand warp_winners[kWarps];
  __shared__ Cand round_winner;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;

  for (int64_t i = blockIdx.x; i < num_rows; i += gridDim.x) {
    int64_t* out_row = out + i * k;
    const int64_t row = static_cast<int64_t>(rows[i]);
    if (row < 0 || row >= num_logits_rows) {
      for (int r = threadIdx.x; r < k; r += blockDim.x) out_row[r] = -1;
      continue;
    }
    const ScalarT* data = logits + row * row_stride;

    ValueT values[kMaxLogitsTopk];
    int64_t indices[kMaxLogitsTopk];
    int count = 0;
    for (int64_t j = threadIdx.x; j < vocab_size; j += blockDim.x) {
      const Cand c{to_compare(data[j]), j};
      // indices arrive increasing: a tie with the k-th entry never enters
      if (count == k && !ranks_above(c, Cand{values[k - 1], indices[k - 1]})) continue;
      int slot = count < k ? count++ : k - 1;
      while (slot > 0 && ranks_above(c, Cand{values[slot - 1], indices[slot - 1]})) {
        values[slot] = values[slot - 1];
        indices[slot] = indices[slot - 1];
        --slot;
      }
      values[slot] = c.value;
      indices[slot] = c.index;
    }

    int head = 0;
    for (int r = 0; r < k; ++r) {
      Cand mine = head < count ? Cand{values[head], indices[head]} : Cand{ValueT(0), -1};
      Cand best = warp_best(mine);
      if (lane == 0) warp_winners[warp] = best;
      __syncthreads();
      if (warp == 0) {
        Cand c = lane < kWarps ? warp_winners[lane] : Cand{ValueT(0), -1};
        c = warp_best(c);
        if (lane == 0) {
          round_winner = c;
          out_row[r] = c.index;
        }
      }
      __syncthreads();
      if (head < count && indices[head] == round_winner.index) ++head;
      __syncthreads();  // round_winner is rewritten next round
    }
  }
}

}  // namespace

template <typename ScalarT, typename RowT>
cudaError_t launch_logits_topk(const ScalarT* logits, int64_t num_logits_rows,
                               int64_t vocab_size, int64_t row_stride,
                               const RowT* rows, int64_t num_rows, int64_t k,
                               int64_t* out, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;  // a zero-block launch is an error
  if (k < 1 || k > kMaxLogitsTopk) return cudaErrorInvalidValue;
  const int64_t blocks = num_rows < 65535 ? num_rows : 65535;
  logits_topk_kernel<ScalarT, RowT><<<static_cast<unsigned int>(blocks), kThreads, 0,
                                      stream>>>(logits, num_logits_rows, vocab_size,
                                                row_stride, rows, num_rows,
                                                static_cast<int>(k), out);
  return cudaGetLastError();
}

#define VLLM_GRAFT_INSTANTIATE_TOPK(ScalarT, RowT)                                   \
  template cudaError_t launch_logits_topk<ScalarT, RowT>(                            \
      const ScalarT*, int64_t, int64_t, int64_t, const RowT*, int64_t, int64_t,      \
      int64_t*, cudaStream_t);

VLLM_GRAFT_INSTANTIATE_TOPK(float, int32_t)
VLLM_GRAFT_INSTANTIATE_TOPK(float, int64_t)
VLLM_GRAFT_INSTANTIATE_TOPK(__half, int32_t)
VLLM_GRAFT_INSTANTIATE_TOPK(__half, int64_t)
VLLM_GRAFT_INSTANTIATE_TOPK(__nv_bfloat16, int32_t)
VLLM_GRAFT_INSTANTIATE_TOPK(__nv_bfloat16, int64_t)
VLLM_GRAFT_INSTANTIATE_TOPK(double, int32_t)
VLLM_GRAFT_INSTANTIATE_TOPK(double, int64_t)
#undef VLLM_GRAFT_INSTANTIATE_TOPK

}  // namespace vllm_graft
