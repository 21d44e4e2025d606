// Schemas and CPU kernels of the fused Graft step: one op per launch for the whole
// bookkeeping of a decoding step, so that a step is a dozen kernels with no wait for
// the host (the CUDA implementations are Triton kernels registered from Python by
// vllm_graft/ops.py: vllm_graft/kernels/graft_step_triton.py and
// tree_finalize_triton.py).
//
//   graft_draft_step      one per draft depth: children scores, the candidate pool,
//                         best-path confidence, checkpoint pruning as a mask, the next
//                         frontier and its lineage (the drafter's next inputs)
//   graft_tree_finalize   drafted-node selection, low-confidence replacement, template
//                         expansion from the successor matrix, trie merge of copied,
//                         drafted and retrieved nodes, padding, source tags, scores,
//                         ancestor bits, the rows the matrix learns from, build stats
//   graft_accept_greedy   the greedy tree walk from the target's top-k at every row,
//                         and the successor-matrix update from the same top-k
//   graft_accept_sampled  the lossless multi-draft walk (temperature, top-k, top-p
//                         applied to the target's logits), and the same update
//
// Semantics are those of the pure-torch path in vllm_graft/core (draft_tree.py,
// graft.py, hybrid.py, acceptance.py); tests compare them element by element. Every
// tensor an op writes is preallocated by the caller (fixed addresses for CUDA graphs).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

namespace vllm_graft {
namespace {

constexpr uint8_t kSourceDraft = 1;
constexpr uint8_t kSourceRetrieved = 2;
constexpr uint8_t kSourcePad = 4;
constexpr uint8_t kSourceContext = 8;
constexpr float kUnknownScore = 0.5f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kStatsColumns = 8;

// ---- checks ----------------------------------------------------------------------
void check_dtype(const char* op, const char* name, const at::Tensor& t,
                 at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
              t.scalar_type());
}

void check_shape(const char* op, const char* name, const at::Tensor& t,
                 c10::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ",
              t.sizes());
}

void check_contiguous_on(const char* op, const char* name, const at::Tensor& t,
                         const at::Tensor& reference) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  TORCH_CHECK(t.device() == reference.device(), op, ": ", name, " is on ", t.device(),
              " but the batch is on ", reference.device());
}

using NamedTensors = std::initializer_list<std::pair<const char*, const at::Tensor*>>;

// Every tensor contiguous and on the device of `reference`.
void check_all_on(const char* op, const at::Tensor& reference, NamedTensors tensors) {
  for (const auto& [name, tensor] : tensors) {
    check_contiguous_on(op, name, *tensor, reference);
  }
}

// A [B] or [B, X] tensor whose rows may be column slices of a wider buffer (the
// packed result a step copies to the host at once): unit stride along a row.
void check_rows_on(const char* op, const char* name, const at::Tensor& t,
                   const at::Tensor& reference) {
  TORCH_CHECK(t.dim() == 1 || t.size(1) <= 1 || t.stride(1) == 1, op, ": ", name,
              " must have unit stride along its rows, got strides ", t.strides());
  TORCH_CHECK(t.device() == reference.device(), op, ": ", name, " is on ", t.device(),
              " but the batch is on ", reference.device());
}

// Row b of a [B] or [B, X] tensor checked by check_rows_on.
template <typename T>
struct Rows {
  T* data;
  int64_t stride;
  T* operator[](int64_t b) const { return data + b * stride; }
};

template <typename T>
Rows<T> rows_of(at::Tensor& t) {
  return Rows<T>{t.mutable_data_ptr<T>(), t.stride(0)};
}

template <typename T>
Rows<const T> rows_of(const at::Tensor& t) {
  return Rows<const T>{t.const_data_ptr<T>(), t.stride(0)};
}

void check_index(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, op, ": ",
              name, " must be int32 or int64, got ", t.scalar_type());
}

template <typename Body>
void visit_index(at::ScalarType dtype, Body&& body) {
  if (dtype == at::kInt) {
    body(int32_t{});
  } else {
    body(int64_t{});
  }
}

template <typename Body>
void visit_float(const char* op, const char* name, at::ScalarType dtype, Body&& body) {
  switch (dtype) {
    case at::kFloat: body(float{}); break;
    case at::kDouble: body(double{}); break;
    case at::kHalf: body(c10::Half{}); break;
    case at::kBFloat16: body(c10::BFloat16{}); break;
    default:
      TORCH_CHECK(false, op, ": ", name,
                  " must be float32, float64, float16 or bfloat16, got ", dtype);
  }
}

// Candidate pool slots: step 0 fills [0, k), step s >= 1 the k*k slots after
// k + (s - 1) * k * k. Returns the tree depth of a slot (root's children = 1).
inline int64_t slot_depth(int64_t slot, int64_t k) {
  return slot < k ? 1 : 2 + (slot - k) / (k * k);
}

inline int64_t step_start(int64_t step, int64_t k) {
  return step == 0 ? 0 : k + (step - 1) * k * k;
}

// ---- graft_draft_step ------------------------------------------------------------
constexpr const char* kDraftStep = "graft_draft_step";

void graft_draft_step_cpu(const at::Tensor& logprobs, const at::Tensor& tokens,
                          const at::Tensor& thresholds, int64_t step,
                          int64_t checkpoint, at::Tensor& pool_tokens,
                          at::Tensor& pool_parents, at::Tensor& pool_scores,
                          at::Tensor& frontier_ids, at::Tensor& frontier_tokens,
                          at::Tensor& frontier_scores, at::Tensor& lineage,
                          at::Tensor& going, at::Tensor& stage, at::Tensor& steps,
                          at::Tensor& confidence) {
  const char* op = kDraftStep;
  TORCH_CHECK(logprobs.dim() == 3, op, ": logprobs must be [B, W, k], got ",
              logprobs.sizes());
  const int64_t batch = logprobs.size(0);
  const int64_t k = logprobs.size(2);
  const int64_t width = logprobs.size(1);
  const int64_t depth = confidence.dim() == 2 ? confidence.size(1) : 0;
  const int64_t pool = pool_tokens.dim() == 2 ? pool_tokens.size(1) : 0;
  TORCH_CHECK(step >= 0 && step < depth, op, ": step ", step, " outside [0, ", depth, ")");
  TORCH_CHECK(width == (step == 0 ? 1 : k), op, ": step ", step, " expands ",
              step == 0 ? 1 : k, " nodes per request, logprobs has ", width);
  TORCH_CHECK(pool == step_start(depth, k), op, ": the pool holds ", pool,
              " slots, top_k ", k, " and ", depth, " steps need ", step_start(depth, k));
  check_shape(op, "tokens", tokens, logprobs.sizes());
  check_index(op, "tokens", tokens);
  check_dtype(op, "thresholds", thresholds, at::kFloat);
  TORCH_CHECK(checkpoint < thresholds.numel(), op, ": checkpoint ", checkpoint,
              " but only ", thresholds.numel(), " thresholds");
  check_dtype(op, "pool_tokens", pool_tokens, at::kLong);
  check_dtype(op, "pool_parents", pool_parents, at::kLong);
  check_dtype(op, "pool_scores", pool_scores, at::kFloat);
  check_shape(op, "pool_parents", pool_parents, pool_tokens.sizes());
  check_shape(op, "pool_scores", pool_scores, pool_tokens.sizes());
  TORCH_CHECK(pool_tokens.size(0) == batch, op, ": pool has ", pool_tokens.size(0),
              " rows, logprobs ", batch);
  check_dtype(op, "frontier_ids", frontier_ids, at::kLong);
  check_dtype(op, "frontier_tokens", frontier_tokens, at::kLong);
  check_dtype(op, "frontier_scores", frontier_scores, at::kFloat);
  check_shape(op, "frontier_ids", frontier_ids, {batch, k});
  check_shape(op, "frontier_tokens", frontier_tokens, {batch, k});
  check_shape(op, "frontier_scores", frontier_scores, {batch, k});
  check_dtype(op, "lineage", lineage, at::kLong);
  check_shape(op, "lineage", lineage, {batch, k, depth});
  check_dtype(op, "going", going, at::kBool);
  check_dtype(op, "stage", stage, at::kLong);
  check_dtype(op, "steps", steps, at::kLong);
  check_dtype(op, "confidence", confidence, at::kFloat);
  check_shape(op, "going", going, {batch});
  check_shape(op, "stage", stage, {batch});
  check_shape(op, "steps", steps, {batch});
  check_all_on(op, logprobs, {
      {"thresholds", &thresholds}, {"pool_tokens", &pool_tokens},
      {"pool_parents", &pool_parents}, {"pool_scores", &pool_scores},
      {"frontier_ids", &frontier_ids}, {"frontier_tokens", &frontier_tokens},
      {"frontier_scores", &frontier_scores}, {"lineage", &lineage}, {"going", &going},
      {"confidence", &confidence}});
  check_rows_on(op, "stage", stage, logprobs);
  check_rows_on(op, "steps", steps, logprobs);
  TORCH_CHECK(tokens.device() == logprobs.device(), op, ": tokens is on ", tokens.device(),
              " but the batch is on ", logprobs.device());
  const at::Tensor lp = logprobs.contiguous();
  const at::Tensor child_tokens = tokens.contiguous();
  const int64_t start = step_start(step, k);
  const int64_t children = width * k;
  const int64_t full_stage = thresholds.numel();

  int64_t* p_tok = pool_tokens.mutable_data_ptr<int64_t>();
  int64_t* p_par = pool_parents.mutable_data_ptr<int64_t>();
  float* p_score = pool_scores.mutable_data_ptr<float>();
  int64_t* f_ids = frontier_ids.mutable_data_ptr<int64_t>();
  int64_t* f_tok = frontier_tokens.mutable_data_ptr<int64_t>();
  float* f_score = frontier_scores.mutable_data_ptr<float>();
  int64_t* lin = lineage.mutable_data_ptr<int64_t>();
  bool* go = going.mutable_data_ptr<bool>();
  const Rows<int64_t> stg = rows_of<int64_t>(stage);
  const Rows<int64_t> stp = rows_of<int64_t>(steps);
  float* conf = confidence.mutable_data_ptr<float>();
  const float* thr = thresholds.const_data_ptr<float>();

  visit_float(op, "logprobs", lp.scalar_type(), [&](auto float_tag) {
    using FloatT = decltype(float_tag);
    const FloatT* lpp = lp.const_data_ptr<FloatT>();
    visit_index(tokens.scalar_type(), [&](auto index_tag) {
      using IndexT = decltype(index_tag);
      const IndexT* tk = child_tokens.const_data_ptr<IndexT>();
      at::parallel_for(0, batch, 8, [&](int64_t begin, int64_t end) {
        std::vector<float> scores(children);
        std::vector<int64_t> order(children);
        std::vector<int64_t> old_lineage(k * depth);
        for (int64_t b = begin; b < end; ++b) {
          if (step == 0) {  // a new build: empty pool, every request drafting
            std::fill(p_tok + b * pool, p_tok + (b + 1) * pool, -1);
            std::fill(p_par + b * pool, p_par + (b + 1) * pool, -1);
            std::fill(p_score + b * pool, p_score + (b + 1) * pool, kNegInf);
            std::fill(lin + b * k * depth, lin + (b + 1) * k * depth, -1);
            std::fill(conf + b * depth, conf + (b + 1) * depth,
                      std::numeric_limits<float>::quiet_NaN());
            go[b] = true;
            *stg[b] = full_stage;
            *stp[b] = 0;
          }
          const bool was_going = go[b];
          *stp[b] += was_going ? 1 : 0;
          float best = kNegInf;
          for (int64_t w = 0; w < width; ++w) {
            const float node = step == 0 ? 0.0f : f_score[b * k + w];
            const int64_t parent = step == 0 ? -1 : f_ids[b * k + w];
            for (int64_t c = 0; c < k; ++c) {
              const int64_t j = w * k + c;
              const int64_t at = (b * width + w) * k + c;
              float s = node + static_cast<float>(lpp[at]);
              if (std::isnan(s)) s = kNegInf;
              if (s == std::numeric_limits<float>::infinity())
                s = std::numeric_limits<float>::max();  // nan_to_num's +inf
              if (!was_going) s = kNegInf;
              scores[j] = s;
              best = std::max(best, s);
              const int64_t slot = b * pool + start + j;
              p_tok[slot] = was_going ? static_cast<int64_t>(tk[at]) : -1;
              p_par[slot] = was_going ? parent : -1;
              p_score[slot] = s;
            }
          }
          const float best_path = std::exp(best);
          conf[b * depth + step] =
              was_going ? best_path : std::numeric_limits<float>::quiet_NaN();
          bool still = was_going;
          if (checkpoint >= 0 && was_going && best_path < thr[checkpoint]) {
            *stg[b] = checkpoint;
            still = false;
          }
          go[b] = still;
          if (step + 1 == depth) continue;
          // next frontier: the k best children, ties to the lower slot
          std::iota(order.begin(), order.end(), 0);
          std::partial_sort(order.begin(), order.begin() + k, order.end(),
                            [&](int64_t x, int64_t y) {
                              return scores[x] > scores[y] ||
                                     (scores[x] == scores[y] && x < y);
                            });
          std::copy(lin + b * k * depth, lin + (b + 1) * k * depth, old_lineage.begin());
          for (int64_t i = 0; i < k; ++i) {
            const int64_t j = order[i];
            const int64_t slot = start + j;
            f_score[b * k + i] = scores[j];
            f_ids[b * k + i] = slot;
            f_tok[b * k + i] = still ? p_tok[b * pool + slot] : -1;
            int64_t* row = lin + (b * k + i) * depth;
            const int64_t parent_index = j / k;  // in this step's frontier
            for (int64_t t = 0; t < depth; ++t) {
              row[t] = (step >= 1 && t >= 1 && t <= step)
                           ? old_lineage[parent_index * depth + t] : -1;
            }
            row[step + 1] = i;
          }
        }
      });
    });
  });
}

// ---- graft_tree_finalize ---------------------------------------------------------
constexpr const char* kFinalize = "graft_tree_finalize";

struct Candidate {
  int64_t token;
  int64_t parent;  // index into the candidate list, 0 = the root
  int64_t depth;
  uint8_t flag;
  float score;
};

void graft_tree_finalize_cpu(
    const at::Tensor& roots, const at::Tensor& pool_tokens,
    const at::Tensor& pool_parents, const at::Tensor& pool_scores,
    const at::Tensor& stage, const at::Tensor& keep_by_stage,
    const at::Tensor& retrieval_keep, const at::Tensor& successors,
    const at::Tensor& partitions, const at::Tensor& template_parents,
    const at::Tensor& template_ranks, const at::Tensor& template_scores,
    const at::Tensor& context_tokens, const at::Tensor& context_parents,
    const at::Tensor& context_depths, int64_t draft_top_k, int64_t draft_capacity,
    double replace_below, int64_t replace_keep, bool spare, bool fixed_shape,
    int64_t vocab_size, at::Tensor& tree_tokens, at::Tensor& tree_parents,
    at::Tensor& tree_depths, at::Tensor& tree_valid, at::Tensor& tree_source,
    at::Tensor& tree_score, at::Tensor& num_nodes, at::Tensor& ancestor_bits,
    at::Tensor& learn_rows, at::Tensor& stats) {
  const char* op = kFinalize;
  check_dtype(op, "roots", roots, at::kLong);
  TORCH_CHECK(roots.dim() == 1, op, ": roots must be [B], got ", roots.sizes());
  const int64_t batch = roots.size(0);
  TORCH_CHECK(tree_tokens.dim() == 2 && tree_tokens.size(0) == batch, op,
              ": tree_tokens must be [B, budget + 1], got ", tree_tokens.sizes());
  const int64_t rows = tree_tokens.size(1);
  const int64_t budget = rows - 1;
  TORCH_CHECK(rows >= 1, op, ": a tree needs its root row");
  const int64_t pool = pool_tokens.dim() == 2 ? pool_tokens.size(1) : 0;
  const bool drafts = pool > 0;
  const bool retrieves = retrieval_keep.numel() > 0;
  const int64_t template_size = template_parents.numel();
  const int64_t context_width = context_tokens.dim() == 2 ? context_tokens.size(1) : 0;
  const int64_t words = ancestor_bits.dim() == 3 ? ancestor_bits.size(2) : 0;
  const int64_t table_rows = successors.dim() == 2 ? successors.size(0) : 0;
  const int64_t succ_k = successors.dim() == 2 ? successors.size(1) : 0;

  check_dtype(op, "pool_tokens", pool_tokens, at::kLong);
  check_dtype(op, "pool_parents", pool_parents, at::kLong);
  check_dtype(op, "pool_scores", pool_scores, at::kFloat);
  TORCH_CHECK(pool_tokens.dim() == 2 && pool_tokens.size(0) == batch, op,
              ": pool_tokens must be [B, pool], got ", pool_tokens.sizes());
  check_shape(op, "pool_parents", pool_parents, pool_tokens.sizes());
  check_shape(op, "pool_scores", pool_scores, pool_tokens.sizes());
  check_dtype(op, "stage", stage, at::kLong);
  check_shape(op, "stage", stage, {batch});
  check_dtype(op, "keep_by_stage", keep_by_stage, at::kLong);
  check_dtype(op, "retrieval_keep", retrieval_keep, at::kLong);
  if (drafts) {
    TORCH_CHECK(keep_by_stage.numel() >= 1, op, ": keep_by_stage is empty");
    TORCH_CHECK(draft_top_k >= 1 && step_start(1, draft_top_k) <= pool, op,
                ": draft_top_k ", draft_top_k, " does not fit a pool of ", pool);
    TORCH_CHECK(draft_capacity >= 0 && draft_capacity <= pool, op,
                ": draft_capacity ", draft_capacity, " outside [0, ", pool, "]");
  }
  if (retrieves) {
    TORCH_CHECK(!drafts || retrieval_keep.numel() == keep_by_stage.numel(), op,
                ": retrieval_keep needs one entry per stage (", keep_by_stage.numel(),
                "), got ", retrieval_keep.numel());
    check_dtype(op, "successors", successors, at::kInt);
    TORCH_CHECK(successors.dim() == 2 && successors.is_contiguous(), op,
                ": successors must be a contiguous [P * V, k] table");
    TORCH_CHECK(vocab_size >= 1 && table_rows % vocab_size == 0, op, ": ", table_rows,
                " table rows are not a whole number of vocabularies of ", vocab_size);
    check_dtype(op, "template_parents", template_parents, at::kLong);
    check_dtype(op, "template_ranks", template_ranks, at::kLong);
    check_dtype(op, "template_scores", template_scores, at::kFloat);
    check_shape(op, "template_ranks", template_ranks, {template_size});
    check_shape(op, "template_scores", template_scores, {template_size});
  }
  check_dtype(op, "partitions", partitions, at::kLong);
  TORCH_CHECK(partitions.numel() == 0 || partitions.sizes() == c10::IntArrayRef{batch},
              op, ": partitions must be [B] or empty, got ", partitions.sizes());
  check_dtype(op, "context_tokens", context_tokens, at::kLong);
  check_dtype(op, "context_parents", context_parents, at::kLong);
  check_dtype(op, "context_depths", context_depths, at::kLong);
  if (context_width > 0) {
    check_shape(op, "context_tokens", context_tokens, {batch, context_width});
    check_shape(op, "context_parents", context_parents, {batch, context_width});
    check_shape(op, "context_depths", context_depths, {batch, context_width});
  }
  TORCH_CHECK(!fixed_shape || budget <= vocab_size, op, ": a fixed-shape tree of ",
              budget, " nodes cannot be padded with distinct tokens of a vocabulary of ",
              vocab_size);
  check_dtype(op, "tree_tokens", tree_tokens, at::kLong);
  check_dtype(op, "tree_parents", tree_parents, at::kLong);
  check_dtype(op, "tree_depths", tree_depths, at::kLong);
  check_dtype(op, "tree_valid", tree_valid, at::kBool);
  check_dtype(op, "tree_source", tree_source, at::kByte);
  check_dtype(op, "tree_score", tree_score, at::kFloat);
  check_dtype(op, "num_nodes", num_nodes, at::kLong);
  check_dtype(op, "ancestor_bits", ancestor_bits, at::kLong);
  check_dtype(op, "learn_rows", learn_rows, at::kLong);
  check_dtype(op, "stats", stats, at::kLong);
  const std::pair<const char*, const at::Tensor*> tree_outputs[] = {
      {"tree_parents", &tree_parents}, {"tree_depths", &tree_depths},
      {"tree_valid", &tree_valid},     {"tree_source", &tree_source},
      {"tree_score", &tree_score},     {"learn_rows", &learn_rows}};
  for (const auto& [name, tensor] : tree_outputs) {
    check_shape(op, name, *tensor, tree_tokens.sizes());
  }
  check_shape(op, "num_nodes", num_nodes, {batch});
  TORCH_CHECK(words * 64 >= rows, op, ": ancestor_bits must be [B, rows, ",
              (rows + 63) / 64, "] int64, got ", ancestor_bits.sizes());
  check_shape(op, "ancestor_bits", ancestor_bits, {batch, rows, words});
  check_shape(op, "stats", stats, {batch, kStatsColumns});
  check_all_on(op, roots, {
      {"pool_tokens", &pool_tokens}, {"pool_parents", &pool_parents},
      {"pool_scores", &pool_scores}, {"keep_by_stage", &keep_by_stage}, {"retrieval_keep", &retrieval_keep},
      {"successors", &successors}, {"partitions", &partitions},
      {"template_parents", &template_parents}, {"template_ranks", &template_ranks},
      {"template_scores", &template_scores}, {"context_tokens", &context_tokens},
      {"context_parents", &context_parents}, {"context_depths", &context_depths},
      {"tree_parents", &tree_parents}, {"tree_depths", &tree_depths},
      {"tree_valid", &tree_valid}, {"tree_source", &tree_source},
      {"tree_score", &tree_score}, {"ancestor_bits", &ancestor_bits},
      {"learn_rows", &learn_rows}});
  check_rows_on(op, "stage", stage, roots);
  check_rows_on(op, "tree_tokens", tree_tokens, roots);
  check_rows_on(op, "num_nodes", num_nodes, roots);
  check_rows_on(op, "stats", stats, roots);

  const int64_t* root = roots.const_data_ptr<int64_t>();
  const int64_t* ptok = pool_tokens.const_data_ptr<int64_t>();
  const int64_t* ppar = pool_parents.const_data_ptr<int64_t>();
  const float* pscore = pool_scores.const_data_ptr<float>();
  const Rows<const int64_t> stg = rows_of<int64_t>(stage);
  const int64_t* keep_stage = keep_by_stage.const_data_ptr<int64_t>();
  const int64_t* rkeep = retrieval_keep.const_data_ptr<int64_t>();
  const int32_t* table = retrieves ? successors.const_data_ptr<int32_t>() : nullptr;
  const int64_t* part = partitions.numel() ? partitions.const_data_ptr<int64_t>() : nullptr;
  const int64_t* tpar = template_parents.const_data_ptr<int64_t>();
  const int64_t* trank = template_ranks.const_data_ptr<int64_t>();
  const float* tscore = template_scores.const_data_ptr<float>();
  const int64_t* ctok = context_tokens.const_data_ptr<int64_t>();
  const int64_t* cpar = context_parents.const_data_ptr<int64_t>();
  const int64_t* cdep = context_depths.const_data_ptr<int64_t>();
  const Rows<int64_t> o_tok = rows_of<int64_t>(tree_tokens);
  int64_t* o_par = tree_parents.mutable_data_ptr<int64_t>();
  int64_t* o_dep = tree_depths.mutable_data_ptr<int64_t>();
  bool* o_valid = tree_valid.mutable_data_ptr<bool>();
  uint8_t* o_src = tree_source.mutable_data_ptr<uint8_t>();
  float* o_score = tree_score.mutable_data_ptr<float>();
  const Rows<int64_t> o_num = rows_of<int64_t>(num_nodes);
  int64_t* o_bits = ancestor_bits.mutable_data_ptr<int64_t>();
  int64_t* o_learn = learn_rows.mutable_data_ptr<int64_t>();
  const Rows<int64_t> o_stats = rows_of<int64_t>(stats);

  const int64_t full_stage = drafts ? keep_by_stage.numel() - 1 : 0;
  const bool replaces = drafts && replace_below > 0.0;
  const float replace_log = static_cast<float>(std::log(replace_below));
  // template depths from its parents (parents-first)
  std::vector<int64_t> template_depth(template_size);
  for (int64_t j = 0; j < template_size; ++j) {
    TORCH_CHECK(tpar[j] >= -1 && tpar[j] < j, op, ": template node ", j, "'s parent ",
                tpar[j], " does not precede it");
    TORCH_CHECK(trank[j] >= 0 && trank[j] < succ_k, op, ": template rank ", trank[j],
                " outside the successor matrix's ", succ_k, " columns");
    template_depth[j] = tpar[j] < 0 ? 1 : template_depth[tpar[j]] + 1;
  }
  const int64_t cap = drafts ? draft_capacity : 0;
  const int64_t num_candidates =
      1 + context_width + cap + (retrieves ? template_size : 0) + (spare ? cap : 0);

  at::parallel_for(0, batch, 4, [&](int64_t begin, int64_t end) {
    std::vector<Candidate> cand(num_candidates);
    std::vector<uint8_t> valid(num_candidates);
    std::vector<int64_t> canon(num_candidates), first_child(num_candidates),
        next_sibling(num_candidates), rank(num_candidates);
    std::vector<uint8_t> merged_flag(num_candidates);
    std::vector<float> merged_score(num_candidates);
    std::vector<int64_t> order(pool), position(pool), ranked_parent(cap);
    std::vector<float> ranked_score(cap);
    std::vector<int64_t> retrieved(template_size);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t partition = part ? part[b] : 0;
      int64_t n = 0;
      cand[n++] = Candidate{root[b], 0, 0, 0, 0.0f};
      for (int64_t i = 0; i < context_width; ++i) {
        const int64_t at = b * context_width + i;
        TORCH_CHECK(ctok[at] < 0 || cpar[at] < i, op, ": context node ", i,
                    " of request ", b, " has parent ", cpar[at], " after it");
        cand[n++] = Candidate{ctok[at], cpar[at] >= 0 ? cpar[at] + 1 : 0, cdep[at],
                              kSourceContext, kUnknownScore};
      }
      int64_t replaced = 0;
      int64_t draft_offset = n;
      if (drafts) {
        // the cap best pool slots, by score, ties to the lower slot (stable sort)
        const int64_t* tok = ptok + b * pool;
        const int64_t* par = ppar + b * pool;
        const float* score = pscore + b * pool;
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + cap, order.end(),
                          [&](int64_t x, int64_t y) {
                            return score[x] > score[y] || (score[x] == score[y] && x < y);
                          });
        std::fill(position.begin(), position.end(), -1);
        for (int64_t r = 0; r < cap; ++r) {
          if (std::isfinite(score[order[r]])) position[order[r]] = r;
        }
        const int64_t request_stage = *stg[b];
        TORCH_CHECK(request_stage >= 0 && request_stage <= full_stage, op, ": stage ",
                    request_stage, " of request ", b, " outside [0, ", full_stage, "]");
        const int64_t keep = keep_stage[request_stage];
        const bool unpruned = request_stage == full_stage;
        for (int64_t r = 0; r < cap; ++r) {
          const int64_t slot = order[r];
          const bool candidate = std::isfinite(score[slot]);
          const bool kept = candidate && r < keep;
          const int64_t parent_slot = par[slot];
          const int64_t parent = parent_slot >= 0 ? position[parent_slot] : -1;
          ranked_parent[r] = candidate ? parent : -1;
          ranked_score[r] = kept ? score[slot] : kNegInf;
          float local = 0.0f;
          if (kept) {
            const float parent_score = parent >= 0 ? ranked_score[parent] : 0.0f;
            local = std::min(std::max(std::exp(score[slot] - parent_score), 0.0f), 1.0f);
          }
          bool drop = false;
          if (kept && replaces && unpruned && r >= replace_keep &&
              ranked_score[r] < replace_log) {
            drop = true;
            ++replaced;
          }
          const int64_t token = kept && !drop ? tok[slot] : -1;
          cand[n++] = Candidate{token, kept && parent >= 0 ? parent + draft_offset : 0,
                                kept ? slot_depth(slot, draft_top_k) : 0, kSourceDraft,
                                local};
        }
      }
      int64_t lookups = 0, hits = 0;
      if (retrieves) {
        const int64_t keep = rkeep[drafts ? *stg[b] : 0];
        const int64_t row_offset = partition * vocab_size;
        for (int64_t j = 0; j < template_size; ++j) {
          const int64_t parent_token = tpar[j] < 0 ? root[b] : retrieved[tpar[j]];
          int64_t token = -1;
          if (parent_token >= 0 && partition >= 0) {
            const int64_t row = parent_token + row_offset;
            TORCH_CHECK(parent_token < vocab_size && row < table_rows, op,
                        ": token ", parent_token, " of request ", b,
                        " has no row in the successor matrix");
            token = table[row * succ_k + trank[j]];
          }
          retrieved[j] = token;
        }
        lookups = std::min(keep, template_size);
        const int64_t offset = n;
        for (int64_t j = 0; j < template_size; ++j) {
          const int64_t token = j < keep ? retrieved[j] : -1;
          hits += token >= 0;
          cand[n++] = Candidate{token, tpar[j] >= 0 ? tpar[j] + offset : 0,
                                template_depth[j], kSourceRetrieved, tscore[j]};
        }
      }
      if (spare) {
        const int64_t offset = n;
        const int64_t* tok = ptok + b * pool;
        const float* score = pscore + b * pool;
        for (int64_t r = 0; r < cap; ++r) {
          const int64_t slot = order[r];
          const bool candidate = std::isfinite(score[slot]);
          const int64_t parent = ranked_parent[r];
          cand[n++] = Candidate{candidate ? tok[slot] : -1,
                                candidate && parent >= 0 ? parent + offset : 0,
                                candidate ? slot_depth(slot, draft_top_k) : 0,
                                kSourceDraft, kUnknownScore};
        }
      }

      // trie merge: validity flows down, a duplicate (same token and depth under the
      // same canonical parent) merges into its earliest copy
      valid[0] = cand[0].token >= 0;
      canon[0] = 0;
      first_child[0] = -1;
      next_sibling[0] = -1;
      merged_flag[0] = 0;
      merged_score[0] = 0.0f;
      for (int64_t i = 1; i < n; ++i) {
        first_child[i] = -1;
        next_sibling[i] = -1;
        merged_flag[i] = 0;
        merged_score[i] = 0.0f;
        const Candidate& c = cand[i];
        valid[i] = c.token >= 0 && valid[c.parent];
        canon[i] = i;
        if (!valid[i]) continue;
        const int64_t canonical_parent = canon[c.parent];
        int64_t last = -1;
        for (int64_t j = first_child[canonical_parent]; j >= 0; j = next_sibling[j]) {
          if (cand[j].token == c.token && cand[j].depth == c.depth) {
            canon[i] = j;
            break;
          }
          last = j;
        }
        if (canon[i] == i) {  // a new node: the last child of its parent
          if (last < 0) {
            first_child[canonical_parent] = i;
          } else {
            next_sibling[last] = i;
          }
        }
      }
      int64_t count = 0;
      for (int64_t i = 0; i < n; ++i) {
        const bool distinct = i == 0 || (valid[i] && canon[i] == i);
        rank[i] = distinct ? count : -1;
        count += distinct;
        if (valid[i]) {
          merged_flag[canon[i]] |= cand[i].flag;
          merged_score[canon[i]] = std::max(merged_score[canon[i]], cand[i].score);
        }
      }
      const int64_t kept_count = std::min(count, rows);
      int64_t* tok_out = o_tok[b];
      int64_t* par_out = o_par + b * rows;
      int64_t* dep_out = o_dep + b * rows;
      bool* valid_out = o_valid + b * rows;
      uint8_t* src_out = o_src + b * rows;
      float* score_out = o_score + b * rows;
      for (int64_t r = 0; r < rows; ++r) {
        tok_out[r] = -1;
        par_out[r] = -1;
        dep_out[r] = 0;
        valid_out[r] = false;
        src_out[r] = 0;
        score_out[r] = 0.0f;
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = rank[i];
        if (r < 0 || r >= rows) continue;
        tok_out[r] = cand[i].token;
        par_out[r] = i == 0 ? -1 : rank[canon[cand[i].parent]];
        dep_out[r] = cand[i].depth;
        valid_out[r] = true;
        src_out[r] = i == 0 ? 0 : merged_flag[i];
        score_out[r] = merged_score[i];
      }
      int64_t nodes = kept_count;
      if (fixed_shape && kept_count < rows) {
        // padding: distinct tokens under the last row (see hybrid.pad_to_budget)
        const int64_t leaf = kept_count - 1;
        for (int64_t r = kept_count; r < rows; ++r) {
          tok_out[r] = (tok_out[leaf] + 1 + (r - kept_count)) % vocab_size;
          par_out[r] = leaf;
          dep_out[r] = dep_out[leaf] + 1;
          valid_out[r] = true;
          src_out[r] = kSourcePad;
          score_out[r] = 0.0f;
        }
        nodes = rows;
      }
      *o_num[b] = nodes;
      int64_t* bits = o_bits + b * rows * words;
      std::fill(bits, bits + rows * words, 0);
      int64_t* learn = o_learn + b * rows;
      int64_t* st = o_stats[b];
      std::fill(st, st + kStatsColumns, 0);
      for (int64_t r = 0; r < rows; ++r) {
        if (!valid_out[r]) {
          learn[r] = -1;
          continue;
        }
        int64_t* row_bits = bits + r * words;
        if (par_out[r] >= 0) {
          std::copy(bits + par_out[r] * words, bits + (par_out[r] + 1) * words, row_bits);
        }
        row_bits[r / 64] |= int64_t{1} << (r % 64);
        const uint8_t src = src_out[r];
        learn[r] = src != kSourcePad && partition >= 0
                       ? tok_out[r] + partition * vocab_size : -1;
        const uint8_t plain = src & static_cast<uint8_t>(0xFF ^ kSourceContext);
        st[0] += (src & kSourceDraft) != 0;
        st[1] += plain == kSourceRetrieved;
        st[2] += plain == (kSourceDraft | kSourceRetrieved);
        st[3] += (src & kSourceContext) != 0;
        st[4] += src == kSourcePad;
      }
      st[5] = replaced;
      st[6] = lookups;
      st[7] = hits;
    }
  });
}

// ---- acceptance --------------------------------------------------------------------
constexpr const char* kGreedy = "graft_accept_greedy";
constexpr const char* kSampled = "graft_accept_sampled";
constexpr int64_t kSourceClasses = 5;  // context, draft, retrieved, both, padding

// The class an accepted node of a tag counts in (graft.accepted_by_source): a copied
// node is "context" whatever else proposed it too; -1 for tags of no class.
inline int64_t source_class(uint8_t tag) {
  if (tag & kSourceContext) return 0;
  switch (tag) {
    case kSourceDraft: return 1;
    case kSourceRetrieved: return 2;
    case kSourceDraft | kSourceRetrieved: return 3;
    case kSourcePad: return 4;
    default: return -1;
  }
}

// The tree and the result tensors every acceptance op takes, checked once.
struct AcceptanceArgs {
  int64_t batch, rows, levels;
  Rows<const int64_t> tokens;
  const int64_t* parents;
  const bool* valid;
  const uint8_t* source;
  Rows<int64_t> accepted, output, num, sources;
};

AcceptanceArgs check_acceptance(const char* op, const at::Tensor& tree_tokens,
                                const at::Tensor& tree_parents,
                                const at::Tensor& tree_valid,
                                const at::Tensor& tree_source, at::Tensor& accepted_rows,
                                at::Tensor& output_tokens, at::Tensor& num_accepted,
                                at::Tensor& accepted_sources) {
  check_dtype(op, "tree_tokens", tree_tokens, at::kLong);
  check_dtype(op, "tree_parents", tree_parents, at::kLong);
  check_dtype(op, "tree_valid", tree_valid, at::kBool);
  check_dtype(op, "tree_source", tree_source, at::kByte);
  TORCH_CHECK(tree_tokens.dim() == 2, op, ": tree_tokens must be [B, rows], got ",
              tree_tokens.sizes());
  const int64_t batch = tree_tokens.size(0);
  check_shape(op, "tree_parents", tree_parents, tree_tokens.sizes());
  check_shape(op, "tree_valid", tree_valid, tree_tokens.sizes());
  check_shape(op, "tree_source", tree_source, tree_tokens.sizes());
  check_dtype(op, "accepted_rows", accepted_rows, at::kLong);
  check_dtype(op, "output_tokens", output_tokens, at::kLong);
  check_dtype(op, "num_accepted", num_accepted, at::kLong);
  check_dtype(op, "accepted_sources", accepted_sources, at::kLong);
  TORCH_CHECK(accepted_rows.dim() == 2 && accepted_rows.size(0) == batch, op,
              ": accepted_rows must be [B, L], got ", accepted_rows.sizes());
  const int64_t levels = accepted_rows.size(1);
  check_shape(op, "output_tokens", output_tokens, {batch, levels + 1});
  check_shape(op, "num_accepted", num_accepted, {batch});
  check_shape(op, "accepted_sources", accepted_sources, {batch, kSourceClasses});
  check_all_on(op, tree_tokens, {{"tree_parents", &tree_parents},
                                 {"tree_valid", &tree_valid},
                                 {"tree_source", &tree_source}});
  for (const auto& [name, tensor] :
       {std::pair<const char*, const at::Tensor*>{"tree_tokens", &tree_tokens},
        {"accepted_rows", &accepted_rows}, {"output_tokens", &output_tokens},
        {"num_accepted", &num_accepted}, {"accepted_sources", &accepted_sources}}) {
    check_rows_on(op, name, *tensor, tree_tokens);
  }
  return AcceptanceArgs{batch,
                        tree_tokens.size(1),
                        levels,
                        rows_of<int64_t>(tree_tokens),
                        tree_parents.const_data_ptr<int64_t>(),
                        tree_valid.const_data_ptr<bool>(),
                        tree_source.const_data_ptr<uint8_t>(),
                        rows_of<int64_t>(accepted_rows),
                        rows_of<int64_t>(output_tokens),
                        rows_of<int64_t>(num_accepted),
                        rows_of<int64_t>(accepted_sources)};
}

void check_update(const char* op, const AcceptanceArgs& args, const at::Tensor& row_topk,
                  const at::Tensor& learn_rows, const at::Tensor& successors,
                  const at::Tensor& reference) {
  check_dtype(op, "row_topk", row_topk, at::kLong);
  TORCH_CHECK(row_topk.dim() == 2 && row_topk.size(0) == args.batch * args.rows, op,
              ": row_topk must be [B * rows, k] = [", args.batch * args.rows,
              ", k], got ", row_topk.sizes());
  check_dtype(op, "learn_rows", learn_rows, at::kLong);
  check_shape(op, "learn_rows", learn_rows, {args.batch, args.rows});
  check_dtype(op, "successors", successors, at::kInt);
  TORCH_CHECK(successors.dim() == 2, op, ": successors must be a [P * V, k] table, got ",
              successors.sizes());
  TORCH_CHECK(successors.size(1) == row_topk.size(1), op, ": successors has k = ",
              successors.size(1), ", row_topk ", row_topk.size(1));
  check_all_on(op, reference, {{"row_topk", &row_topk}, {"learn_rows", &learn_rows},
                               {"successors", &successors}});
}

// Every learned row writes the target's top-k into its token's matrix row; rows are
// written in flat (request, row) order, so the last one of a token wins.
void update_successors(const char* op, const at::Tensor& row_topk,
                       const at::Tensor& learn_rows, at::Tensor& successors,
                       int64_t vocab_size) {
  const int64_t* top = row_topk.const_data_ptr<int64_t>();
  const int64_t* learn = learn_rows.const_data_ptr<int64_t>();
  int32_t* table = successors.mutable_data_ptr<int32_t>();
  const int64_t k = successors.size(1);
  const int64_t table_rows = successors.size(0);
  const int64_t n = learn_rows.numel();
  for (int64_t i = 0; i < n; ++i) {  // check everything before the first write
    if (learn[i] < 0) continue;
    TORCH_CHECK_VALUE(learn[i] < table_rows, op, ": learn_rows[", i, "] = ", learn[i],
                      " is outside the matrix's ", table_rows, " rows");
    for (int64_t c = 0; c < k; ++c) {
      TORCH_CHECK_VALUE(top[i * k + c] >= 0 && top[i * k + c] < vocab_size, op,
                        ": row_topk[", i, ", ", c, "] = ", top[i * k + c],
                        " is out of range [0, ", vocab_size, ")");
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (learn[i] < 0) continue;
    for (int64_t c = 0; c < k; ++c) {
      table[learn[i] * k + c] = static_cast<int32_t>(top[i * k + c]);
    }
  }
}

// One request's walk: `emit(level, current)` is the token the target emits at tree
// row `current`; the child carrying it is accepted and the walk goes on from it.
template <typename Emit>
void walk_request(const char* op, const AcceptanceArgs& a, int64_t b, Emit&& emit) {
  const int64_t* tok = a.tokens[b];
  const int64_t* par = a.parents + b * a.rows;
  const bool* valid = a.valid + b * a.rows;
  const uint8_t* source = a.source + b * a.rows;
  int64_t* accepted = a.accepted[b];
  int64_t* output = a.output[b];
  int64_t* sources = a.sources[b];
  std::fill(accepted, accepted + a.levels, -1);
  std::fill(output, output + a.levels + 1, -1);
  std::fill(sources, sources + kSourceClasses, 0);
  int64_t current = 0, count = 0;
  for (int64_t level = 0; level <= a.levels; ++level) {
    const int64_t emitted = emit(level, current);
    output[level] = emitted;
    int64_t child = -1;
    for (int64_t r = 1; r < a.rows && child < 0; ++r) {
      if (valid[r] && par[r] == current && tok[r] == emitted) child = r;
    }
    if (child < 0) break;
    TORCH_CHECK(level < a.levels, op, ": request ", b, "'s tree is deeper than the ",
                a.levels, " levels of accepted_rows");
    accepted[level] = child;
    const int64_t cls = source_class(source[child]);
    if (cls >= 0) ++sources[cls];
    current = child;
    ++count;
  }
  *a.num[b] = count;
}

void graft_accept_greedy_cpu(const at::Tensor& tree_tokens, const at::Tensor& tree_parents,
                             const at::Tensor& tree_valid, const at::Tensor& tree_source,
                             const at::Tensor& row_topk, const at::Tensor& learn_rows,
                             int64_t vocab_size, at::Tensor& successors,
                             at::Tensor& accepted_rows, at::Tensor& output_tokens,
                             at::Tensor& num_accepted, at::Tensor& accepted_sources) {
  const char* op = kGreedy;
  const AcceptanceArgs args =
      check_acceptance(op, tree_tokens, tree_parents, tree_valid, tree_source,
                       accepted_rows, output_tokens, num_accepted, accepted_sources);
  check_update(op, args, row_topk, learn_rows, successors, tree_tokens);
  const int64_t* top = row_topk.const_data_ptr<int64_t>();
  const int64_t k = row_topk.size(1);
  for (int64_t b = 0; b < args.batch; ++b) {
    walk_request(op, args, b, [&](int64_t, int64_t current) {
      return top[(b * args.rows + current) * k];
    });
  }
  update_successors(op, row_topk, learn_rows, successors, vocab_size);
}

// An order-preserving unsigned key of a float: a < b iff key(a) < key(b), and
// equal floats have equal keys.
inline uint32_t order_key(float x) {
  if (x == 0.0f) x = 0.0f;  // -0.0 and +0.0 compare equal: one key
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Top-p: zeroes exps[v] of every token whose ascending cumulative probability (the
// mass of the tokens up to it in ascending order of value, itself included) is at
// most `floor` = 1 - p, the largest token excepted. Radix select rather than a sort:
// the tokens go into buckets by the top bits of their key, the bucket the cut falls
// in into finer ones, and only the finest bucket at the cut is sorted.
void drop_below_top_p(const std::vector<float>& work, std::vector<float>& exps,
                      int64_t vocab, double total, float floor,
                      std::vector<int64_t>& members) {
  constexpr int kBits = 12;
  constexpr uint32_t kBuckets = 1u << kBits;
  // the token top-p never drops: the last of the ascending order, i.e. the highest
  // index among equal largest values (the order members are sorted in below)
  int64_t largest = 0;
  for (int64_t v = 1; v < vocab; ++v) {
    if (work[v] >= work[largest]) largest = v;
  }
  // Narrow [lo, hi] of key space to the bucket the cut falls in: the one whose tokens
  // below it hold at most `floor` of the mass while with it they would not; `below`
  // is the mass under lo. Every token above the bucket is kept, every one under it
  // dropped.
  uint32_t lo = 0, hi = 0xFFFFFFFFu;
  double below = 0.0;
  std::vector<double> mass(kBuckets);
  for (const int shift : {32 - kBits, 32 - 2 * kBits}) {
    std::fill(mass.begin(), mass.end(), 0.0);
    double inside = 0.0;
    for (int64_t v = 0; v < vocab; ++v) {
      const uint32_t key = order_key(work[v]);
      if (key < lo || key > hi) continue;
      mass[(key >> shift) & (kBuckets - 1)] += exps[v];
      inside += exps[v];
    }
    double above = 0.0;
    uint32_t cut = 0;
    for (int64_t j = kBuckets - 1; j >= 0; --j) {
      if (static_cast<float>((below + inside - above - mass[j]) / total) <= floor) {
        cut = static_cast<uint32_t>(j);
        break;
      }
      above += mass[j];
    }
    below += inside - above - mass[cut];
    lo = (lo & ~(((kBuckets - 1) << shift) | ((1u << shift) - 1))) | (cut << shift);
    hi = lo | ((1u << shift) - 1);
  }
  // the finest bucket at the cut, in ascending order of value, token by token
  members.clear();
  for (int64_t v = 0; v < vocab; ++v) {
    const uint32_t key = order_key(work[v]);
    if (key >= lo && key <= hi) members.push_back(v);
  }
  std::sort(members.begin(), members.end(), [&](int64_t x, int64_t y) {
    return work[x] < work[y] || (work[x] == work[y] && x < y);
  });
  double cumulative = below;
  std::vector<int64_t> dropped;
  for (const int64_t v : members) {
    cumulative += exps[v];
    if (static_cast<float>(cumulative / total) <= floor) dropped.push_back(v);
  }
  for (int64_t v = 0; v < vocab; ++v) {
    if (order_key(work[v]) < lo && v != largest) exps[v] = 0.0f;
  }
  for (const int64_t v : dropped) {
    if (v != largest) exps[v] = 0.0f;
  }
}

// The target distribution plain sampling draws from, as vLLM 0.32's sampler makes
// it: temperature, then top-k (ties with the k-th value kept), then top-p (the
// largest tokens whose mass, counted from the smallest up, exceeds 1 - p; the
// largest token always), then softmax. Writes probabilities (float64) into `probs`.
template <typename FloatT>
void sampling_distribution(const FloatT* logits, int64_t vocab, float temperature,
                           int64_t top_k, float top_p, std::vector<float>& work,
                           std::vector<int64_t>& order, std::vector<double>& probs) {
  const float scale = std::max(temperature, 1e-6f);
  for (int64_t v = 0; v < vocab; ++v) work[v] = static_cast<float>(logits[v]) / scale;
  if (top_k > 0 && top_k < vocab) {
    std::vector<float> copy(work.begin(), work.begin() + vocab);
    std::nth_element(copy.begin(), copy.begin() + (top_k - 1), copy.end(),
                     std::greater<float>());
    const float kth = copy[top_k - 1];
    for (int64_t v = 0; v < vocab; ++v) {
      if (work[v] < kth) work[v] = kNegInf;
    }
  }
  float max_value = kNegInf;
  for (int64_t v = 0; v < vocab; ++v) max_value = std::max(max_value, work[v]);
  double total = 0.0;
  std::vector<float> exps(vocab);
  for (int64_t v = 0; v < vocab; ++v) {
    exps[v] = work[v] == kNegInf ? 0.0f : std::exp(work[v] - max_value);
    total += exps[v];
  }
  if (top_p < 1.0f) {
    drop_below_top_p(work, exps, vocab, total, 1.0f - top_p, order);
    total = 0.0;
    for (int64_t v = 0; v < vocab; ++v) total += exps[v];
  }
  for (int64_t v = 0; v < vocab; ++v) probs[v] = exps[v] / total;
}

void graft_accept_sampled_cpu(
    const at::Tensor& logits, const at::Tensor& logit_rows, const at::Tensor& tree_tokens,
    const at::Tensor& tree_parents, const at::Tensor& tree_valid,
    const at::Tensor& tree_source, const at::Tensor& temperature, const at::Tensor& top_k,
    const at::Tensor& top_p, const at::Tensor& uniforms, const at::Tensor& row_topk,
    const at::Tensor& learn_rows, int64_t vocab_size, at::Tensor& successors,
    at::Tensor& accepted_rows, at::Tensor& output_tokens, at::Tensor& num_accepted,
    at::Tensor& accepted_sources) {
  const char* op = kSampled;
  const AcceptanceArgs args =
      check_acceptance(op, tree_tokens, tree_parents, tree_valid, tree_source,
                       accepted_rows, output_tokens, num_accepted, accepted_sources);
  check_update(op, args, row_topk, learn_rows, successors, tree_tokens);
  const int64_t batch = args.batch, rows = args.rows, levels = args.levels;
  TORCH_CHECK(logits.dim() == 2 && (logits.size(1) <= 1 || logits.stride(1) == 1), op,
              ": logits must be [N, V] with contiguous rows, got shape ", logits.sizes(),
              " and strides ", logits.strides());
  TORCH_CHECK(logits.device() == tree_tokens.device(), op, ": logits is on ",
              logits.device(), " but the batch is on ", tree_tokens.device());
  const int64_t vocab = logits.size(1);
  check_dtype(op, "logit_rows", logit_rows, at::kLong);
  check_shape(op, "logit_rows", logit_rows, {batch, rows});
  check_dtype(op, "temperature", temperature, at::kFloat);
  check_dtype(op, "top_k", top_k, at::kLong);
  check_dtype(op, "top_p", top_p, at::kFloat);
  check_shape(op, "temperature", temperature, {batch});
  check_shape(op, "top_k", top_k, {batch});
  check_shape(op, "top_p", top_p, {batch});
  check_dtype(op, "uniforms", uniforms, at::kFloat);
  check_shape(op, "uniforms", uniforms, {batch, levels + 1, rows + 1});
  check_all_on(op, tree_tokens, {{"logit_rows", &logit_rows}, {"temperature", &temperature},
                                 {"top_k", &top_k}, {"top_p", &top_p},
                                 {"uniforms", &uniforms}});
  const int64_t* lrow = logit_rows.const_data_ptr<int64_t>();
  const float* temp = temperature.const_data_ptr<float>();
  const int64_t* tk = top_k.const_data_ptr<int64_t>();
  const float* tp = top_p.const_data_ptr<float>();
  const float* u = uniforms.const_data_ptr<float>();
  const int64_t* top = row_topk.const_data_ptr<int64_t>();
  const int64_t k = row_topk.size(1);
  const int64_t num_logits = logits.size(0);
  const int64_t stride = logits.stride(0);

  visit_float(op, "logits", logits.scalar_type(), [&](auto float_tag) {
    using FloatT = decltype(float_tag);
    const FloatT* base = logits.const_data_ptr<FloatT>();
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> work(vocab);
      std::vector<int64_t> order(vocab);
      std::vector<double> probs(vocab), residual(vocab), child_mass(rows), accept(rows);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t* t = args.tokens[b];
        const int64_t* p = args.parents + b * rows;
        const bool* v = args.valid + b * rows;
        const bool greedy = temp[b] <= 0.0f;
        walk_request(op, args, b, [&](int64_t level, int64_t current) -> int64_t {
          if (greedy) return top[(b * rows + current) * k];
          const int64_t row = lrow[b * rows + current];
          TORCH_CHECK(row >= 0 && row < num_logits, op, ": logit_rows[", b, ", ",
                      current, "] = ", row, " is outside the ", num_logits,
                      " logits rows");
          sampling_distribution(base + row * stride, vocab, temp[b], tk[b], tp[b], work,
                                order, probs);
          // the multi-draft rule: children in row order, one-hot proposals
          std::copy(probs.begin(), probs.end(), residual.begin());
          for (int64_t r = 1; r < rows; ++r) {
            child_mass[r] = 0.0;
            if (v[r] && p[r] == current) {
              TORCH_CHECK(t[r] >= 0 && t[r] < vocab, op, ": tree token ", t[r],
                          " is outside the logits' vocabulary of ", vocab);
              child_mass[r] = probs[t[r]];
              residual[t[r]] = 0.0;
            }
          }
          double residual_mass = 0.0;
          for (int64_t x = 0; x < vocab; ++x) residual_mass += residual[x];
          // the mass left before child r: the residual plus the children from r on
          double children_from = 0.0;
          for (int64_t r = rows - 1; r >= 1; --r) {
            children_from += child_mass[r];
            accept[r] = child_mass[r] / std::max(residual_mass + children_from, 1e-300);
          }
          const float* level_u = u + (b * (levels + 1) + level) * (rows + 1);
          for (int64_t r = 1; r < rows; ++r) {
            if (v[r] && p[r] == current && static_cast<double>(level_u[r]) < accept[r]) {
              return t[r];
            }
          }
          // every child rejected: a sample of the residual, by its cumulative mass
          const double target = static_cast<double>(level_u[rows]) * residual_mass;
          double cdf = 0.0;
          for (int64_t x = 0; x < vocab; ++x) {
            cdf += residual[x];
            if (cdf > target) return x;
          }
          return vocab - 1;
        });
      }
    });
  });
  update_successors(op, row_topk, learn_rows, successors, vocab_size);
}

}  // namespace
}  // namespace vllm_graft

TORCH_LIBRARY_FRAGMENT(vllm_graft, m) {
  // One draft depth of a batch's trees (see the file comment). logprobs / tokens:
  // [B, W, k], the drafter's top-k at each frontier node (W = 1 at step 0, the root;
  // k after). State, written in place: pool_* [B, C] (C = k + (D - 1) k^2),
  // frontier_* [B, k] (the next step's nodes: pool slots, tokens (-1 for a stopped
  // request), path scores), lineage [B, k, D] (each frontier node's ancestor at every
  // depth, as an index into that depth's frontier), going [B] bool, stage / steps [B]
  // int64, confidence [B, D]. Step 0 resets the state. checkpoint: the index of the
  // threshold this step is judged by, -1 for none.
  m.def(
      "graft_draft_step(Tensor logprobs, Tensor tokens, Tensor thresholds, int step, "
      "int checkpoint, Tensor(a!) pool_tokens, Tensor(b!) pool_parents, "
      "Tensor(c!) pool_scores, Tensor(d!) frontier_ids, Tensor(e!) frontier_tokens, "
      "Tensor(f!) frontier_scores, Tensor(g!) lineage, Tensor(h!) going, "
      "Tensor(i!) stage, Tensor(j!) steps, Tensor(k!) confidence) -> ()");
  // The hybrid tree of every request, flattened parents-first into budget + 1 rows
  // (see vllm_graft/core/graft.py and hybrid.py for the rules it follows).
  m.def(
      "graft_tree_finalize(Tensor roots, Tensor pool_tokens, Tensor pool_parents, "
      "Tensor pool_scores, Tensor stage, Tensor keep_by_stage, Tensor retrieval_keep, "
      "Tensor successors, Tensor partitions, Tensor template_parents, "
      "Tensor template_ranks, Tensor template_scores, Tensor context_tokens, "
      "Tensor context_parents, Tensor context_depths, int draft_top_k, "
      "int draft_capacity, float replace_below, int replace_keep, bool spare, "
      "bool fixed_shape, int vocab_size, Tensor(a!) tree_tokens, "
      "Tensor(b!) tree_parents, Tensor(c!) tree_depths, Tensor(d!) tree_valid, "
      "Tensor(e!) tree_source, Tensor(f!) tree_score, Tensor(g!) num_nodes, "
      "Tensor(h!) ancestor_bits, Tensor(i!) learn_rows, Tensor(j!) stats) -> ()");
  // Greedy walk of every tree from the target's top-k at each row (row_topk
  // [B * rows, k], column 0 the argmax), and the successor-matrix update from it.
  m.def(
      "graft_accept_greedy(Tensor tree_tokens, Tensor tree_parents, Tensor tree_valid, "
      "Tensor tree_source, Tensor row_topk, Tensor learn_rows, int vocab_size, "
      "Tensor(a!) successors, Tensor(b!) accepted_rows, Tensor(c!) output_tokens, "
      "Tensor(d!) num_accepted, Tensor(e!) accepted_sources) -> ()");
  // The lossless sampled walk (temperature <= 0: greedy) and the same update.
  m.def(
      "graft_accept_sampled(Tensor logits, Tensor logit_rows, Tensor tree_tokens, "
      "Tensor tree_parents, Tensor tree_valid, Tensor tree_source, Tensor temperature, "
      "Tensor top_k, Tensor top_p, Tensor uniforms, Tensor row_topk, Tensor learn_rows, "
      "int vocab_size, Tensor(a!) successors, Tensor(b!) accepted_rows, "
      "Tensor(c!) output_tokens, Tensor(d!) num_accepted, Tensor(e!) accepted_sources) "
      "-> ()");
}

TORCH_LIBRARY_IMPL(vllm_graft, CPU, m) {
  m.impl("graft_draft_step", &vllm_graft::graft_draft_step_cpu);
  m.impl("graft_tree_finalize", &vllm_graft::graft_tree_finalize_cpu);
  m.impl("graft_accept_greedy", &vllm_graft::graft_accept_greedy_cpu);
  m.impl("graft_accept_sampled", &vllm_graft::graft_accept_sampled_cpu);
}
