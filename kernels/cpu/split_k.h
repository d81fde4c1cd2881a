// Finalizing one work item's query vectors and combining split-K partials (SEMANTICS.md §6), CPU side.
#ifndef MSA_OPS_CPU_SPLIT_K_H_
#define MSA_OPS_CPU_SPLIT_K_H_

#include <cstdint>
#include <vector>

#include "handler_util.h"
#include "msa_ops/softmax.h"
#include "thread_pool.h"

namespace msa_ops {
namespace cpu {

// Output side of an attention problem: rows are flat rows of out[rows, H, D]; partials live in
// ws_o[np, rows, H, D] / ws_lse[np, rows, H] when np > 1.
struct AttnOutput {
  DataType out_type;
  void* out;
  float* ws_o;
  float* ws_lse;
  int64_t rows, H, D, np;
  bool has_sink = false;
  const float* sink2 = nullptr;  // [H] sink in log2 units (when has_sink)
};

// One query vector (row, head) of partition p is done: write the final row (np == 1) or the partial.
inline void finish_query(const AttnOutput& o, int64_t row, int64_t h, int64_t p, const OnlineSoftmax& st,
                         const float* acc) {
  const float lse = st.lse2();
  const int64_t D = o.D;
  const float inv_l = st.empty() ? 0.f : 1.f / st.l;
  if (o.np <= 1) {
    const float m = lse;
    const float w = combine_weight(lse, m);
    const float denom = combine_denominator(w, o.has_sink, o.has_sink ? o.sink2[h] : 0.f, m);
    const float mul = combine_scale(w, denom, m) * inv_l;
    store_row(o.out_type, o.out, (row * o.H + h) * D, acc, mul, D);
  } else {
    float* dst = o.ws_o + ((p * o.rows + row) * o.H + h) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[d] * inv_l;
    o.ws_lse[(p * o.rows + row) * o.H + h] = lse;
  }
}

// Combines the partials of the given rows (np > 1) into out.
inline void combine_rows(const AttnOutput& o, const std::vector<int64_t>& rows) {
  if (o.np <= 1 || rows.empty()) return;
  ThreadPool::instance().parallel_for(static_cast<int64_t>(rows.size()), [&](int64_t ri) {
    const int64_t row = rows[ri];
    std::vector<float> buf(o.D);
    for (int64_t h = 0; h < o.H; ++h) {
      float m = neg_inf();
      for (int64_t p = 0; p < o.np; ++p) {
        const float l = o.ws_lse[(p * o.rows + row) * o.H + h];
        if (l > m) m = l;
      }
      float sum_w = 0.f;
      for (int64_t p = 0; p < o.np; ++p) sum_w += combine_weight(o.ws_lse[(p * o.rows + row) * o.H + h], m);
      const float denom = combine_denominator(sum_w, o.has_sink, o.has_sink ? o.sink2[h] : 0.f, m);
      for (int64_t d = 0; d < o.D; ++d) buf[d] = 0.f;
      for (int64_t p = 0; p < o.np; ++p) {
        const float c = combine_scale(combine_weight(o.ws_lse[(p * o.rows + row) * o.H + h], m), denom, m);
        if (c == 0.f) continue;
        const float* src = o.ws_o + ((p * o.rows + row) * o.H + h) * o.D;
        for (int64_t d = 0; d < o.D; ++d) buf[d] += c * src[d];
      }
      store_row(o.out_type, o.out, (row * o.H + h) * o.D, buf.data(), 1.f, o.D);
    }
  });
}

// Checks the output and the split-K workspace results (msa_ops/checks.h) and fills the output description.
inline Error setup_output(const char* target, AttnOutput& o, DataType dt, AnyBuffer q, AnyResult out, AnyResult ws_o,
                   AnyResult ws_lse, int64_t rows, int64_t H, int64_t D, int64_t np) {
  if (auto e = check_attention_output(target, dt, q, *out, *ws_o, *ws_lse, rows, H, D, np); e.failure()) return e;
  o.out_type = dt;
  o.out = out->untyped_data();
  o.rows = rows;
  o.H = H;
  o.D = D;
  o.np = np;
  o.ws_o = np > 1 ? static_cast<float*>(ws_o->untyped_data()) : nullptr;
  o.ws_lse = np > 1 ? static_cast<float*>(ws_lse->untyped_data()) : nullptr;
  return Error::Success();
}

}  // namespace cpu
}  // namespace msa_ops

#endif  // MSA_OPS_CPU_SPLIT_K_H_
