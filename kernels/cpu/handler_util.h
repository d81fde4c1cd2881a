// Small helpers shared by the CPU handlers: operand checks, dtype dispatch, row stores.
#ifndef MSA_OPS_CPU_HANDLER_UTIL_H_
#define MSA_OPS_CPU_HANDLER_UTIL_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "msa_ops/dtypes.h"
#include "msa_ops/ffi.h"

namespace msa_ops {
namespace cpu {

inline std::string dims_str(const AnyBuffer& b) {
  std::string s = "[";
  auto d = b.dimensions();
  for (size_t i = 0; i < d.size(); ++i) s += (i ? "," : "") + std::to_string(d[i]);
  return s + "]";
}

inline bool is_index_type(const AnyBuffer& b) {
  return b.element_type() == DataType::S32 || b.element_type() == DataType::U32;
}

// Checks an int32/uint32 operand of exactly `count` elements (rank-free: the lowering decides shapes).
inline Error check_index(const char* target, const char* name, const AnyBuffer& b, int64_t count) {
  if (!is_index_type(b))
    return invalid(target, std::string(name) + ": expected int32 or uint32");
  if (static_cast<int64_t>(b.element_count()) != count)
    return invalid(target, std::string(name) + ": expected " + std::to_string(count) + " elements, got shape " +
                               dims_str(b));
  return Error::Success();
}

inline Error check_shape(const char* target, const char* name, const AnyBuffer& b,
                         std::initializer_list<int64_t> expected) {
  auto d = b.dimensions();
  bool ok = d.size() == expected.size();
  size_t i = 0;
  for (int64_t e : expected) {
    if (!ok) break;
    ok = d[i++] == e;
  }
  if (!ok) {
    std::string s = "[";
    i = 0;
    for (int64_t e : expected) s += (i++ ? "," : "") + std::to_string(e);
    return invalid(target, std::string(name) + ": expected shape " + s + "], got " + dims_str(b));
  }
  return Error::Success();
}

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

inline const char* dtype_name(DataType t) {
  switch (t) {
    case DataType::F32: return "float32";
    case DataType::BF16: return "bfloat16";
    case DataType::F16: return "float16";
    case DataType::F8E4M3FN: return "float8_e4m3fn";
    case DataType::S32: return "int32";
    case DataType::U32: return "uint32";
    default: return "other";
  }
}

}  // namespace cpu
}  // namespace msa_ops

#endif  // MSA_OPS_CPU_HANDLER_UTIL_H_
