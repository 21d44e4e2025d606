#include "topk_kernels.cuh"

namespace vllm_graft {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
static_assert(kLogitsTopkSliceAlign == kThreads, "a slice is a whole number of block strides");
static_assert(kMaxLogitsTopkSplits <= kThreads, "the merge gives each slice one thread");

// Values are compared in float (double for float64 logits): exact for every
// input dtype, so column 0 equals torch.argmax.
template <typename ScalarT>
using compare_t = typename LogitsTopkValue<ScalarT>::type;

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

// Shared memory of select_rounds.
template <typename ValueT>
struct RoundState {
  Candidate<ValueT> warp_winners[kWarps];
  Candidate<ValueT> winner;
};

// Each thread scans [begin, end) with the block's stride (coalesced reads:
// neighbouring threads read neighbouring logits) keeping its own sorted top-k
// in values / indices; returns how many it keeps (fewer than k on a short
// slice).
template <typename ScalarT, typename ValueT>
__device__ __forceinline__ int scan_slice(const ScalarT* __restrict__ data, int64_t begin,
                                          int64_t end, int k, ValueT* values,
                                          int64_t* indices) {
  using Cand = Candidate<ValueT>;
  int count = 0;
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
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
  return count;
}

// k rounds of a block-wide arg-best over the heads of the threads' lists (each
// sorted best first, their indices disjoint, so exactly one thread advances per
// round) pick the block's top-k in order: thread 0 calls emit(r, winner), with
// index -1 once every list is spent. Every thread of the block calls it.
template <typename ValueT, typename Emit>
__device__ __forceinline__ void select_rounds(const ValueT* values, const int64_t* indices,
                                              int count, int k, RoundState<ValueT>& state,
                                              Emit emit) {
  using Cand = Candidate<ValueT>;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  int head = 0;
  for (int r = 0; r < k; ++r) {
    Cand mine = head < count ? Cand{values[head], indices[head]} : Cand{ValueT(0), -1};
    Cand best = warp_best(mine);
    if (lane == 0) state.warp_winners[warp] = best;
    __syncthreads();
    if (warp == 0) {
      Cand c = lane < kWarps ? state.warp_winners[lane] : Cand{ValueT(0), -1};
      c = warp_best(c);
      if (lane == 0) {
        state.winner = c;
        emit(r, c);
      }
    }
    __syncthreads();
    if (head < count && indices[head] == state.winner.index) ++head;
    __syncthreads();  // winner is rewritten next round
  }
}

// Block (x, s) takes the top-k of slice s, [s * slice_length, (s + 1) *
// slice_length) clipped to the row, of output rows x, x + gridDim.x, ...
// One slice (gridDim.y == 1): written to out directly. Several: each block
// writes its slice's list to the workspace and takes a ticket; the block that
// draws the row's last ticket merges the lists with the same rounds (the global
// top-k is within the union of the slices' top-k) and resets the ticket.
template <typename ScalarT, typename RowT>
__global__ void logits_topk_kernel(const ScalarT* __restrict__ logits,
                                   int64_t num_logits_rows, int64_t vocab_size,
                                   int64_t row_stride, const RowT* __restrict__ rows,
                                   int64_t num_rows, int k, int64_t slice_length,
                                   compare_t<ScalarT>* split_values,
                                   int64_t* split_indices, unsigned int* tickets,
                                   int64_t* __restrict__ out) {
  using ValueT = compare_t<ScalarT>;
  using Cand = Candidate<ValueT>;
  __shared__ RoundState<ValueT> state;
  __shared__ bool merges;  // this block drew its row's last ticket
  const int64_t splits = gridDim.y;
  const int64_t split = blockIdx.y;
  const int64_t begin = split * slice_length;
  const int64_t end = begin + slice_length < vocab_size ? begin + slice_length : vocab_size;

  for (int64_t i = blockIdx.x; i < num_rows; i += gridDim.x) {
    int64_t* out_row = out + i * k;
    const int64_t row = static_cast<int64_t>(rows[i]);
    if (row < 0 || row >= num_logits_rows) {
      // every slice sees the same id: slice 0 writes, none takes a ticket
      if (split == 0) {
        for (int r = threadIdx.x; r < k; r += blockDim.x) out_row[r] = -1;
      }
      continue;
    }
    const ScalarT* data = logits + row * row_stride;

    ValueT values[kMaxLogitsTopk];
    int64_t indices[kMaxLogitsTopk];
    int count = scan_slice(data, begin, end, k, values, indices);

    if (splits == 1) {
      select_rounds(values, indices, count, k, state,
                    [&](int r, const Cand& c) { out_row[r] = c.index; });
      continue;
    }

    const int64_t list = (i * splits + split) * k;
    select_rounds(values, indices, count, k, state, [&](int r, const Cand& c) {
      split_values[list + r] = c.value;
      split_indices[list + r] = c.index;
    });
    // Thread 0 wrote the list: fence it before the ticket (release); the last
    // ticket's drawer fences after it (acquire), so it sees every slice's list.
    if (threadIdx.x == 0) {
      __threadfence();
      const unsigned int ticket = atomicAdd(tickets + i, 1u);
      const bool last = ticket == static_cast<unsigned int>(splits - 1);
      if (last) {
        __threadfence();
        tickets[i] = 0;  // every slice has drawn: clean for the next launch
      }
      merges = last;
    }
    __syncthreads();
    if (!merges) continue;

    // Thread s holds slice s's list (volatile: other blocks wrote it during
    // this launch); a list ends at its first -1.
    count = 0;
    if (threadIdx.x < splits) {
      const volatile ValueT* slice_values = split_values + (i * splits + threadIdx.x) * k;
      const volatile int64_t* slice_indices = split_indices + (i * splits + threadIdx.x) * k;
      while (count < k) {
        const int64_t index = slice_indices[count];
        if (index < 0) break;
        values[count] = slice_values[count];
        indices[count] = index;
        ++count;
      }
    }
    select_rounds(values, indices, count, k, state,
                  [&](int r, const Cand& c) { out_row[r] = c.index; });
  }
}

}  // namespace

cudaError_t logits_topk_splits(int64_t num_rows, int64_t vocab_size, int64_t* splits) {
  *splits = 1;
  int device = 0;
  int sm_count = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) {
    status = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  }
  if (status == cudaSuccess) {
    *splits = logits_topk_split_count(num_rows, vocab_size, sm_count);
  }
  return status;
}

template <typename ScalarT, typename RowT>
cudaError_t launch_logits_topk(const ScalarT* logits, int64_t num_logits_rows,
                               int64_t vocab_size, int64_t row_stride,
                               const RowT* rows, int64_t num_rows, int64_t k,
                               int64_t splits,
                               typename LogitsTopkValue<ScalarT>::type* split_values,
                               int64_t* split_indices, unsigned int* tickets,
                               int64_t* out, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;  // a zero-block launch is an error
  if (k < 1 || k > kMaxLogitsTopk) return cudaErrorInvalidValue;
  if (splits < 1 || splits > kMaxLogitsTopkSplits) return cudaErrorInvalidValue;
  const bool has_workspace =
      split_values != nullptr && split_indices != nullptr && tickets != nullptr;
  if (splits > 1 && !has_workspace) return cudaErrorInvalidValue;
  const int64_t blocks = num_rows < 65535 ? num_rows : 65535;
  const dim3 grid(static_cast<unsigned int>(blocks), static_cast<unsigned int>(splits));
  logits_topk_kernel<ScalarT, RowT><<<grid, kThreads, 0, stream>>>(
      logits, num_logits_rows, vocab_size, row_stride, rows, num_rows,
      static_cast<int>(k), logits_topk_slice_length(vocab_size, splits), split_values,
      split_indices, tickets, out);
  return cudaGetLastError();
}

#define VLLM_GRAFT_INSTANTIATE_TOPK(ScalarT, RowT)                                   \
  template cudaError_t launch_logits_topk<ScalarT, RowT>(                            \
      const ScalarT*, int64_t, int64_t, int64_t, const RowT*, int64_t, int64_t,      \
      int64_t, LogitsTopkValue<ScalarT>::type*, int64_t*, unsigned int*, int64_t*,   \
      cudaStream_t);

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
