#include "successor_kernels.cuh"

namespace vllm_graft {
namespace {

constexpr int kThreadsPerBlock = 256;
// Enough blocks to fill any current GPU; grid-stride loops cover the rest.
constexpr int64_t kMaxBlocks = 65535;

unsigned int blocks_for(int64_t work_items) {
  const int64_t needed = (work_items + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return static_cast<unsigned int>(needed < kMaxBlocks ? needed : kMaxBlocks);
}

__device__ int64_t grid_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

__device__ int64_t global_thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

template <typename IndexT>
__global__ void successor_gather_kernel(const int32_t* __restrict__ successors,
                                        int64_t vocab_size, int64_t k,
                                        const IndexT* __restrict__ parent_tokens,
                                        const IndexT* __restrict__ ranks,
                                        int32_t* __restrict__ out,
                                        int64_t num_nodes) {
  for (int64_t node = global_thread_index(); node < num_nodes;
       node += grid_stride()) {
    const int64_t parent = static_cast<int64_t>(parent_tokens[node]);
    const int64_t rank = static_cast<int64_t>(ranks[node]);
    const bool inside_matrix =
        parent >= 0 && parent < vocab_size && rank >= 0 && rank < k;
    out[node] = inside_matrix ? successors[parent * k + rank] : -1;
  }
}

// True when a node after `node` carries the same token, i.e. its row write
// would land later in sequential order and therefore wins.
template <typename TokenT>
__device__ bool overwritten_by_later_node(const TokenT* __restrict__ tokens,
                                          int64_t node, int64_t num_nodes,
                                          int64_t token) {
  for (int64_t later = node + 1; later < num_nodes; ++later) {
    if (static_cast<int64_t>(tokens[later]) == token) return true;
  }
  return false;
}

// One thread per (node, column) so reads of next_tokens and writes of a row
// are coalesced. The O(num_nodes) scan per thread is cheap for the few
// thousand tree nodes of a verification step.
template <typename TokenT, typename NextTokenT>
__global__ void successor_update_kernel(int32_t* __restrict__ successors,
                                        int64_t vocab_size, int64_t k,
                                        const TokenT* __restrict__ tokens,
                                        const NextTokenT* __restrict__ next_tokens,
                                        int64_t num_nodes) {
  const int64_t num_entries = num_nodes * k;
  for (int64_t entry = global_thread_index(); entry < num_entries;
       entry += grid_stride()) {
    const int64_t node = entry / k;
    const int64_t column = entry - node * k;
    const int64_t token = static_cast<int64_t>(tokens[node]);
    if (token < 0 || token >= vocab_size) continue;
    if (overwritten_by_later_node(tokens, node, num_nodes, token)) continue;
    successors[token * k + column] = static_cast<int32_t>(next_tokens[entry]);
  }
}

}  // namespace

template <typename IndexT>
cudaError_t launch_successor_gather(const int32_t* successors,
                                    int64_t vocab_size, int64_t k,
                                    const IndexT* parent_tokens,
                                    const IndexT* ranks, int32_t* out,
                                    int64_t num_nodes, cudaStream_t stream) {
  if (num_nodes == 0) return cudaSuccess;  // a zero-block launch is an error
  successor_gather_kernel<IndexT>
      <<<blocks_for(num_nodes), kThreadsPerBlock, 0, stream>>>(
          successors, vocab_size, k, parent_tokens, ranks, out, num_nodes);
  return cudaGetLastError();
}

template <typename TokenT, typename NextTokenT>
cudaError_t launch_successor_update(int32_t* successors, int64_t vocab_size,
                                    int64_t k, const TokenT* tokens,
                                    const NextTokenT* next_tokens,
                                    int64_t num_nodes, cudaStream_t stream) {
  const int64_t num_entries = num_nodes * k;
  if (num_entries == 0) return cudaSuccess;
  successor_update_kernel<TokenT, NextTokenT>
      <<<blocks_for(num_entries), kThreadsPerBlock, 0, stream>>>(
          successors, vocab_size, k, tokens, next_tokens, num_nodes);
  return cudaGetLastError();
}

template cudaError_t launch_successor_gather<int32_t>(
    const int32_t*, int64_t, int64_t, const int32_t*, const int32_t*, int32_t*,
    int64_t, cudaStream_t);
template cudaError_t launch_successor_gather<int64_t>(
    const int32_t*, int64_t, int64_t, const int64_t*, const int64_t*, int32_t*,
    int64_t, cudaStream_t);

template cudaError_t launch_successor_update<int32_t, int32_t>(
    int32_t*, int64_t, int64_t, const int32_t*, const int32_t*, int64_t,
    cudaStream_t);
template cudaError_t launch_successor_update<int32_t, int64_t>(
    int32_t*, int64_t, int64_t, const int32_t*, const int64_t*, int64_t,
    cudaStream_t);
template cudaError_t launch_successor_update<int64_t, int32_t>(
    int32_t*, int64_t, int64_t, const int64_t*, const int32_t*, int64_t,
    cudaStream_t);
template cudaError_t launch_successor_update<int64_t, int64_t>(
    int32_t*, int64_t, int64_t, const int64_t*, const int64_t*, int64_t,
    cudaStream_t);

}  // namespace vllm_graft
