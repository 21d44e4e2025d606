// CUDA kernels for the successor matrix used to draft tokens.
//
// The successor matrix is a row-major [vocab_size, k] int32 array: row t holds
// the k most likely tokens to follow token t (most likely first), -1 = empty.
//
// This header is torch-free on purpose: the kernels compile with plain nvcc
// and are bound to torch in ops_cuda.cpp. The launchers do not validate ids
// (that would need a device sync); they are memory-safe instead: an id outside
// the matrix never causes an out-of-bounds access (see each launcher).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace vllm_graft {

// out[i] = successors[parent_tokens[i], ranks[i]] if parent_tokens[i] >= 0,
// else -1. A parent id >= vocab_size or a rank outside [0, k) also yields -1.
// IndexT is int32_t or int64_t (parent_tokens and ranks share it).
template <typename IndexT>
cudaError_t launch_successor_gather(const int32_t* successors,
                                    int64_t vocab_size, int64_t k,
                                    const IndexT* parent_tokens,
                                    const IndexT* ranks, int32_t* out,
                                    int64_t num_nodes, cudaStream_t stream);

// successors[tokens[i], :] = next_tokens[i, :] for every node i whose token is
// in [0, vocab_size); nodes with token -1 (padding) or an out-of-range token
// are skipped. next_tokens is row-major [num_nodes, k].
//
// Winner rule: when several nodes carry the same token, the node with the
// highest index wins, exactly as if the rows were written in index order. Each
// (node, column) thread writes only if no later node has the same token, so
// the result is deterministic and needs no atomics.
template <typename TokenT, typename NextTokenT>
cudaError_t launch_successor_update(int32_t* successors, int64_t vocab_size,
                                    int64_t k, const TokenT* tokens,
                                    const NextTokenT* next_tokens,
                                    int64_t num_nodes, cudaStream_t stream);

}  // namespace vllm_graft
