// Schemas and CPU kernels of the successor-matrix ops, plus the Python module
// stub that lets `import vllm_graft._C` load this library (loading it runs the
// TORCH_LIBRARY registrations below).
//
// The successor matrix is a contiguous [V, k] int32 tensor: row t holds the k
// most likely tokens to follow token t, most likely first; -1 = empty.
#include <Python.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

extern "C" {
// Lets Python import the library as a module; the module itself is empty.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", NULL, -1, NULL};
  return PyModule_Create(&module_def);
}
}

namespace vllm_graft {
namespace {

constexpr const char* kGather = "successor_gather";
constexpr const char* kUpdate = "successor_update_";
constexpr const char* kTopk = "logits_topk";
// successor_k's upper bound in graft.json; the CUDA kernel keeps k entries per thread
constexpr int64_t kMaxTopk = 64;
constexpr int64_t kGrainSize = 2048;

bool is_index_dtype(at::ScalarType dtype) {
  return dtype == at::kInt || dtype == at::kLong;
}

// Calls `body(int32_t{})` or `body(int64_t{})` matching `dtype`, so nested
// dispatch over two independent index dtypes stays readable.
template <typename Body>
void visit_index_dtype(at::ScalarType dtype, Body&& body) {
  if (dtype == at::kInt) {
    body(int32_t{});
  } else {
    body(int64_t{});
  }
}

void check_successor_matrix(const char* op, const at::Tensor& successors) {
  TORCH_CHECK(successors.scalar_type() == at::kInt, op,
              ": successors must be int32, got ", successors.scalar_type());
  TORCH_CHECK(successors.dim() == 2, op,
              ": successors must be 2-D [V, k], got shape ", successors.sizes());
  TORCH_CHECK(successors.size(1) >= 1, op,
              ": successors must have at least one column, got shape ",
              successors.sizes());
  TORCH_CHECK(successors.is_contiguous(), op,
              ": successors must be contiguous, got shape ", successors.sizes(),
              " with strides ", successors.strides());
}

void check_index_tensor(const char* op, const char* name,
                        const at::Tensor& ids, int64_t expected_dim) {
  TORCH_CHECK(is_index_dtype(ids.scalar_type()), op, ": ", name,
              " must be int32 or int64, got ", ids.scalar_type());
  TORCH_CHECK(ids.dim() == expected_dim, op, ": ", name, " must be ",
              expected_dim, "-D, got shape ", ids.sizes());
}

void check_same_device(const char* op, const at::Tensor& reference,
                       const char* name, const at::Tensor& other,
                       const char* reference_name = "successors") {
  TORCH_CHECK(other.device() == reference.device(), op, ": ", name,
              " is on ", other.device(), " but ", reference_name, " is on ",
              reference.device());
}

std::string element_position(const at::Tensor& ids, int64_t flat_index) {
  if (ids.dim() == 2) {
    const int64_t columns = ids.size(1);
    return "[" + std::to_string(flat_index / columns) + ", " +
           std::to_string(flat_index % columns) + "]";
  }
  return "[" + std::to_string(flat_index) + "]";
}

// Raises ValueError naming the first id outside [low, high).
template <typename IdT>
void check_ids_in_range(const char* op, const char* name,
                        const at::Tensor& contiguous_ids, int64_t low,
                        int64_t high) {
  const IdT* ids = contiguous_ids.const_data_ptr<IdT>();
  for (int64_t flat = 0; flat < contiguous_ids.numel(); ++flat) {
    const int64_t id = static_cast<int64_t>(ids[flat]);
    TORCH_CHECK_VALUE(id >= low && id < high, op, ": ", name,
                      element_position(contiguous_ids, flat), " = ", id,
                      " is out of range [", low, ", ", high, ")");
  }
}

// Raises ValueError naming the first next-token id outside [0, vocab_size) in
// the row of a written node; rows of skipped nodes (token -1) are never read.
template <typename TokenT, typename NextTokenT>
void check_next_tokens_in_range(const at::Tensor& contiguous_tokens,
                                const at::Tensor& contiguous_next_tokens,
                                int64_t vocab_size) {
  const TokenT* tokens = contiguous_tokens.const_data_ptr<TokenT>();
  const NextTokenT* next = contiguous_next_tokens.const_data_ptr<NextTokenT>();
  const int64_t k = contiguous_next_tokens.size(1);
  for (int64_t node = 0; node < contiguous_tokens.numel(); ++node) {
    if (static_cast<int64_t>(tokens[node]) < 0) continue;
    for (int64_t column = 0; column < k; ++column) {
      const int64_t id = static_cast<int64_t>(next[node * k + column]);
      TORCH_CHECK_VALUE(id >= 0 && id < vocab_size, kUpdate, ": next_tokens[", node,
                        ", ", column, "] = ", id, " is out of range [0, ",
                        vocab_size, ")");
    }
  }
}

// Nodes whose row write survives sequential application: for each token the
// valid node with the highest index. Their target rows are pairwise distinct.
template <typename TokenT>
std::vector<int64_t> winning_nodes(const TokenT* tokens, int64_t num_nodes) {
  std::vector<int64_t> winners;
  std::unordered_set<int64_t> written_tokens;
  written_tokens.reserve(static_cast<size_t>(num_nodes));
  for (int64_t node = num_nodes - 1; node >= 0; --node) {
    const int64_t token = static_cast<int64_t>(tokens[node]);
    if (token >= 0 && written_tokens.insert(token).second) {
      winners.push_back(node);
    }
  }
  return winners;
}

}  // namespace

// Shape, dtype and device checks shared with the CUDA bindings (ops_cuda.cpp).
// Id ranges are checked separately because that needs the values on the host.
void check_gather_inputs(const at::Tensor& successors,
                         const at::Tensor& parent_tokens,
                         const at::Tensor& ranks) {
  check_successor_matrix(kGather, successors);
  check_index_tensor(kGather, "parent_tokens", parent_tokens, 1);
  check_index_tensor(kGather, "ranks", ranks, 1);
  TORCH_CHECK(ranks.scalar_type() == parent_tokens.scalar_type(), kGather,
              ": ranks must have the dtype of parent_tokens (",
              parent_tokens.scalar_type(), "), got ", ranks.scalar_type());
  TORCH_CHECK(ranks.size(0) == parent_tokens.size(0), kGather,
              ": ranks has ", ranks.size(0), " entries but parent_tokens has ",
              parent_tokens.size(0));
  check_same_device(kGather, successors, "parent_tokens", parent_tokens);
  check_same_device(kGather, successors, "ranks", ranks);
}

void check_update_inputs(const at::Tensor& successors,
                         const at::Tensor& tokens,
                         const at::Tensor& next_tokens) {
  check_successor_matrix(kUpdate, successors);
  check_index_tensor(kUpdate, "tokens", tokens, 1);
  check_index_tensor(kUpdate, "next_tokens", next_tokens, 2);
  TORCH_CHECK(next_tokens.size(0) == tokens.size(0), kUpdate,
              ": next_tokens has ", next_tokens.size(0),
              " rows but tokens has ", tokens.size(0), " entries");
  TORCH_CHECK(next_tokens.size(1) == successors.size(1), kUpdate,
              ": next_tokens has k = ", next_tokens.size(1),
              " columns but successors has k = ", successors.size(1));
  check_same_device(kUpdate, successors, "tokens", tokens);
  check_same_device(kUpdate, successors, "next_tokens", next_tokens);
}

void check_topk_inputs(const at::Tensor& logits, const at::Tensor& rows,
                       int64_t k) {
  const at::ScalarType dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 ||
                  dtype == at::kDouble,
              kTopk, ": logits must be float32, float16, bfloat16 or float64, got ",
              dtype);
  TORCH_CHECK(logits.dim() == 2, kTopk, ": logits must be 2-D [rows, vocab], got shape ",
              logits.sizes());
  TORCH_CHECK(logits.size(1) == 0 || logits.stride(1) == 1, kTopk,
              ": logits rows must be contiguous (stride 1 along the vocabulary), got "
              "strides ", logits.strides());
  check_index_tensor(kTopk, "rows", rows, 1);
  check_same_device(kTopk, logits, "rows", rows, "logits");
  TORCH_CHECK(k >= 1 && k <= kMaxTopk, kTopk, ": k must be in [1, ", kMaxTopk,
              "], got ", k);
  TORCH_CHECK(k <= logits.size(1), kTopk, ": k = ", k, " exceeds the vocabulary (",
              logits.size(1), " columns)");
}

namespace {

at::Tensor successor_gather_cpu(const at::Tensor& successors,
                                const at::Tensor& parent_tokens,
                                const at::Tensor& ranks) {
  check_gather_inputs(successors, parent_tokens, ranks);
  const at::Tensor parents = parent_tokens.contiguous();
  const at::Tensor parent_ranks = ranks.contiguous();
  const int64_t vocab_size = successors.size(0);
  const int64_t k = successors.size(1);
  const int64_t num_nodes = parents.size(0);
  at::Tensor out = at::empty({num_nodes}, successors.options());

  visit_index_dtype(parents.scalar_type(), [&](auto index_tag) {
    using IndexT = decltype(index_tag);
    check_ids_in_range<IndexT>(kGather, "parent_tokens", parents, -1,
                               vocab_size);
    check_ids_in_range<IndexT>(kGather, "ranks", parent_ranks, 0, k);
    const int32_t* matrix = successors.const_data_ptr<int32_t>();
    const IndexT* parent_ids = parents.const_data_ptr<IndexT>();
    const IndexT* rank_ids = parent_ranks.const_data_ptr<IndexT>();
    int32_t* out_ids = out.mutable_data_ptr<int32_t>();
    at::parallel_for(0, num_nodes, kGrainSize, [&](int64_t begin, int64_t end) {
      for (int64_t node = begin; node < end; ++node) {
        const int64_t parent = static_cast<int64_t>(parent_ids[node]);
        out_ids[node] =
            parent < 0 ? -1 : matrix[parent * k + static_cast<int64_t>(rank_ids[node])];
      }
    });
  });
  return out;
}

void successor_update_cpu(at::Tensor& successors, const at::Tensor& tokens,
                          const at::Tensor& next_tokens) {
  check_update_inputs(successors, tokens, next_tokens);
  const at::Tensor node_tokens = tokens.contiguous();
  const at::Tensor node_next_tokens = next_tokens.contiguous();
  const int64_t vocab_size = successors.size(0);
  const int64_t k = successors.size(1);

  visit_index_dtype(node_tokens.scalar_type(), [&](auto token_tag) {
    using TokenT = decltype(token_tag);
    visit_index_dtype(node_next_tokens.scalar_type(), [&](auto next_tag) {
      using NextTokenT = decltype(next_tag);
      // Validate everything before the first write so a rejected call leaves
      // the matrix untouched.
      check_ids_in_range<TokenT>(kUpdate, "tokens", node_tokens, -1,
                                 vocab_size);
      check_next_tokens_in_range<TokenT, NextTokenT>(node_tokens, node_next_tokens,
                                                     vocab_size);
      const TokenT* token_ids = node_tokens.const_data_ptr<TokenT>();
      const NextTokenT* next_ids = node_next_tokens.const_data_ptr<NextTokenT>();
      int32_t* matrix = successors.mutable_data_ptr<int32_t>();
      const std::vector<int64_t> winners =
          winning_nodes(token_ids, node_tokens.size(0));
      const int64_t num_winners = static_cast<int64_t>(winners.size());
      const int64_t rows_per_task = kGrainSize / k + 1;
      at::parallel_for(0, num_winners, rows_per_task,
                       [&](int64_t begin, int64_t end) {
        for (int64_t w = begin; w < end; ++w) {
          const int64_t node = winners[w];
          int32_t* row = matrix + static_cast<int64_t>(token_ids[node]) * k;
          const NextTokenT* next_row = next_ids + node * k;
          for (int64_t column = 0; column < k; ++column) {
            row[column] = static_cast<int32_t>(next_row[column]);
          }
        }
      });
    });
  });
}

}  // namespace
}  // namespace vllm_graft

TORCH_LIBRARY(vllm_graft, m) {
  // out[i] = successors[parent_tokens[i], ranks[i]], or -1 where
  // parent_tokens[i] == -1. successors: contiguous [V, k] int32.
  // parent_tokens, ranks: [N], both int32 or both int64, parent in [-1, V),
  // rank in [0, k). Returns [N] int32.
  m.def(
      "successor_gather(Tensor successors, Tensor parent_tokens, "
      "Tensor ranks) -> Tensor");
  // successors[tokens[i], :] = next_tokens[i, :] for every i with
  // tokens[i] != -1. tokens: [N] int32/int64 in [-1, V); next_tokens: [N, k]
  // int32/int64 in [0, V) (rows of skipped nodes are not read). When several
  // nodes carry the same token the node with the HIGHEST index wins (as if
  // written sequentially in index order), identically and deterministically on
  // every device.
  m.def(
      "successor_update_(Tensor(a!) successors, Tensor tokens, "
      "Tensor next_tokens) -> ()");
  // out[i] = the indices of the k largest entries of logits[rows[i]], best
  // first: larger value first, equal values by lower index, NaN above every
  // number; column 0 is torch.argmax of the row. rows[i] == -1 gives a row of
  // -1. logits: [R, V] float32/float16/bfloat16/float64, contiguous rows; rows:
  // [N] int32/int64 in [-1, R); 1 <= k <= min(64, V). Returns [N, k] int64.
  // One pass over each selected row with a k-entry buffer.
  m.def("logits_topk(Tensor logits, Tensor rows, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_graft, CPU, m) {
  m.impl("successor_gather", &vllm_graft::successor_gather_cpu);
  m.impl("successor_update_", &vllm_graft::successor_update_cpu);
}
