// The layout of the Triton fold's launch plan: its one definition. gradaccel/ops/csrc/accumulate.cpp writes
// plans in it; the extension's fold_plan_layout() hands it to gradaccel/ops/triton/accumulate.py, which
// reads plans through it (nothing in Python restates these numbers).
//
// A plan is one int64 CPU tensor: the header; the indices of the `strided` non-contiguous grads
// (folded one by one); `rows` table rows, one per non-empty contiguous grad; then the
// block -> row map as `blocks` int32 values, packed two per int64 slot.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <iterator>
#include <map>
#include <string>

namespace gradaccel::fold_plan {

// Header slots. The three starts spare the reader any arithmetic on the layout.
enum Header : int64_t {
  kRows,         // table rows
  kBlocks,       // programs of the launch
  kAligned,      // 1 if every row's grad and slice start on 16 bytes
  kStrided,      // non-contiguous grads, listed right after the header
  kTableStart,   // slot of the first table row
  kMapStart,     // slot of the block map
  kEnd,          // slots used
  kHeaderLen,
};

// Columns of a table row.
enum Column : int64_t {
  kAddress,     // the grad's data address
  kNumel,       // its elements
  kOffset,      // where its slice of the flat buffer starts
  kFirstBlock,  // the first program that folds it
  kDtype,       // its dtype, as an index into kDtypes
  kRowWidth,
};

// The grad dtypes the fold reads; a row names its grad's dtype by its index here.
inline constexpr c10::ScalarType kDtypes[] = {c10::kFloat, c10::kBFloat16, c10::kHalf};

inline int64_t dtype_code(c10::ScalarType t) {
  const int64_t n = static_cast<int64_t>(std::size(kDtypes));
  int64_t code = 0;
  while (code < n && kDtypes[code] != t) ++code;
  TORCH_CHECK_VALUE(code < n, "gradaccel: the fold reads no grad of dtype ", t);
  return code;
}

// Slots that the plan of `n_grads` grads into `flat_numel` elements may need: disjoint slices hold
// at most `flat_numel` elements, so they span at most `flat_numel / block + n_grads` blocks.
inline int64_t capacity(int64_t flat_numel, int64_t n_grads, int64_t block) {
  return kHeaderLen + n_grads + kRowWidth * n_grads + (flat_numel / block + n_grads + 1) / 2;
}

// The layout by name, for Python: {"header": {...}, "row": {...}, "dtype": {"float32": 0, ...}}.
inline std::map<std::string, std::map<std::string, int64_t>> layout() {
  std::map<std::string, int64_t> dtypes;
  for (int64_t i = 0; i < static_cast<int64_t>(std::size(kDtypes)); ++i) {
    dtypes[std::string(c10::getDtypeNames(kDtypes[i]).first)] = i;
  }
  return {
      {"header", {{"rows", kRows}, {"blocks", kBlocks}, {"aligned", kAligned}, {"strided", kStrided},
                  {"table_start", kTableStart}, {"map_start", kMapStart}, {"end", kEnd},
                  {"length", kHeaderLen}}},
      {"row", {{"address", kAddress}, {"numel", kNumel}, {"offset", kOffset},
               {"first_block", kFirstBlock}, {"dtype", kDtype}, {"width", kRowWidth}}},
      {"dtype", dtypes},
  };
}

}  // namespace gradaccel::fold_plan
