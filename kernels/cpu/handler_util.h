// Small helpers shared by the CPU handlers: scalar reads, dtype dispatch, row stores (the operand checks are
// msa_ops/checks.h, shared with the CUDA handlers).
#ifndef MSA_OPS_CPU_HANDLER_UTIL_H_
#define MSA_OPS_CPU_HANDLER_UTIL_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "msa_ops/checks.h"
#include "msa_ops/dtypes.h"
#include "msa_ops/ffi.h"

namespace msa_ops {
namespace cpu {

inline int32_t read_i32_scalar(const AnyBuffer& b) {
  int32_t v;
  std::memcpy(&v, b.untyped_data(), 4);
  return v;
}

inline const int32_t* idx(const AnyBuffer& b) { return static_cast<const int32_t*>(b.untyped_data()); }

inline bool is_attn_float(DataType t) {
  return t == DataType::F32 || t == DataType::BF16 || t == DataType::F16;
}

inline float load_float(DataType t, const void* p, int64_t i) {
  switch (t) {
    case DataType::F32: return static_cast<const float*>(p)[i];
    case DataType::BF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DataType::F16: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DataType::F8E4M3FN: return f8e4m3_to_float(static_cast<const uint8_t*>(p)[i]);
    default: return 0.f;
  }
}

// out[base .. base+n) = vals * mul, converted to dtype t.
inline void store_row(DataType t, void* p, int64_t base, const float* vals, float mul, int64_t n) {
  switch (t) {
    case DataType::F32: {
      float* o = static_cast<float*>(p) + base;
      for (int64_t i = 0; i < n; ++i) o[i] = vals[i] * mul;
      break;
    }
    case DataType::BF16: {
      uint16_t* o = static_cast<uint16_t*>(p) + base;
      for (int64_t i = 0; i < n; ++i) o[i] = float_to_bf16(vals[i] * mul);
      break;
    }
    case DataType::F16: {
      uint16_t* o = static_cast<uint16_t*>(p) + base;
      for (int64_t i = 0; i < n; ++i) o[i] = float_to_f16(vals[i] * mul);
      break;
    }
    default:
      break;
  }
}

}  // namespace cpu
}  // namespace msa_ops

#endif  // MSA_OPS_CPU_HANDLER_UTIL_H_
