// Element types and their conversions to/from f32 (round to nearest even), host and device.
#ifndef MSA_OPS_DTYPES_H_
#define MSA_OPS_DTYPES_H_

#include <cstdint>
#include <cstring>

#include "msa_ops/common.h"

namespace msa_ops {

struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };
struct f8e4m3_t { uint8_t bits; };

MSA_HD inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
MSA_HD inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// ---- bfloat16 ----
MSA_HD inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }
MSA_HD inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<uint16_t>(u >> 16);
}

// ---- IEEE half ----
MSA_HD inline float f16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    // zero or subnormal: man * 2^-24
    float v = static_cast<float>(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}
MSA_HD inline uint16_t float_to_f16(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520 -> inf
  if (a < 0x38800000u) {
    // result is subnormal (or zero) in half: value / 2^-24, rounded to nearest even
    if (a < 0x33000000u) return sign;  // < 2^-25: rounds to 0
    uint32_t exp = a >> 23;
    uint32_t man = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - exp;  // 113 - exp + 13
    uint32_t res = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (res & 1u))) res += 1u;
    return static_cast<uint16_t>(sign | res);
  }
  uint32_t lsb = (a >> 13) & 1u;
  a += 0xfffu + lsb;
  a -= 112u << 23;
  return static_cast<uint16_t>(sign | (a >> 13));
}

// ---- float8 e4m3fn (no inf; 0x7f / 0xff = NaN; max 448) ----
MSA_HD inline float f8e4m3_to_float(uint8_t b) {
  uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  uint32_t exp = (b >> 3) & 0xfu;
  uint32_t man = b & 0x7u;
  if (exp == 0xf && man == 0x7) return bits_float(sign | 0x7fc00000u);
  if (exp == 0) {
    float v = static_cast<float>(man) * 0.001953125f;  // man * 2^-9
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 120u) << 23) | (man << 20));
}
MSA_HD inline uint8_t float_to_f8e4m3(float f) {
  uint32_t u = float_bits(f);
  uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);  // NaN
  if (a < 0x3c800000u) {
    // below 2^-6: subnormal grid of 2^-9 (or zero)
    if (a < 0x3a000000u) return sign;  // < 2^-11 rounds to 0 (ties at 2^-10 handled below)
    uint32_t exp = a >> 23;
    uint32_t man = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 141u - exp;  // value/2^-9 = man * 2^(exp-127-23+9)
    uint32_t res = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (res & 1u))) res += 1u;
    return static_cast<uint8_t>(sign | res);
  }
  uint32_t lsb = (a >> 20) & 1u;
  a += 0x7ffffu + lsb;
  uint32_t r = (a >> 20) - (120u << 3);
  if (r > 0x7eu) return static_cast<uint8_t>(sign | 0x7fu);  // overflow -> NaN (e4m3fn has no inf)
  return static_cast<uint8_t>(sign | r);
}

// Generic accessors.
MSA_HD inline float to_float(float x) { return x; }
MSA_HD inline float to_float(bf16_t x) { return bf16_to_float(x.bits); }
MSA_HD inline float to_float(f16_t x) { return f16_to_float(x.bits); }
MSA_HD inline float to_float(f8e4m3_t x) { return f8e4m3_to_float(x.bits); }

template <typename T> struct FromFloat;
template <> struct FromFloat<float> { MSA_HD static float conv(float f) { return f; } };
template <> struct FromFloat<bf16_t> { MSA_HD static bf16_t conv(float f) { return bf16_t{float_to_bf16(f)}; } };
template <> struct FromFloat<f16_t> { MSA_HD static f16_t conv(float f) { return f16_t{float_to_f16(f)}; } };
template <> struct FromFloat<f8e4m3_t> { MSA_HD static f8e4m3_t conv(float f) { return f8e4m3_t{float_to_f8e4m3(f)}; } };
template <typename T> MSA_HD inline T from_float(float f) { return FromFloat<T>::conv(f); }

}  // namespace msa_ops

#endif  // MSA_OPS_DTYPES_H_
