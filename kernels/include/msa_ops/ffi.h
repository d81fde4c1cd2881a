// Short aliases for the XLA FFI C++ API (from the installed jaxlib).
#ifndef MSA_OPS_FFI_H_
#define MSA_OPS_FFI_H_

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace msa_ops {
namespace ffi = ::xla::ffi;

using ffi::AnyBuffer;
using ffi::DataType;
using ffi::Error;
using ffi::Result;
using AnyResult = ffi::Result<ffi::AnyBuffer>;
using Dims = ffi::AnyBuffer::Dimensions;

inline int64_t dim(const AnyBuffer& b, int i) {
  auto d = b.dimensions();
  return (i >= 0 && static_cast<size_t>(i) < d.size()) ? d[i] : 0;
}
inline int64_t rank(const AnyBuffer& b) { return static_cast<int64_t>(b.dimensions().size()); }
inline Error invalid(const std::string& target, const std::string& what) {
  return Error::InvalidArgument(target + ": " + what);
}

}  // namespace msa_ops

#endif  // MSA_OPS_FFI_H_
