// The XLA FFI signature of every target, written once for both platforms (docs/SEMANTICS.md, "Native (XLA FFI)
// contract"). MSA_OPS_SIG_<TARGET>(binder) appends the target's operands, attributes and results to `binder`:
// `ffi::Ffi::Bind()` in the CPU library, `ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()` in the CUDA
// one. A platform that needs more (the CUDA indexer's score workspace) appends it after the macro.
#ifndef MSA_OPS_FFI_SIGNATURES_H_
#define MSA_OPS_FFI_SIGNATURES_H_

#include "msa_ops/ffi.h"

#define MSA_OPS_BUF ::msa_ops::AnyBuffer

#define MSA_OPS_SIG_MHA_RAGGED_PAGED(B)                                                                       \
  (B).Arg<MSA_OPS_BUF>()                                                 /* q */                             \
      .Arg<MSA_OPS_BUF>()                                                /* input_row_offsets */             \
      .Arg<MSA_OPS_BUF>()                                                /* kv_blocks */                     \
      .Arg<MSA_OPS_BUF>()                                                /* cache_lengths */                 \
      .Arg<MSA_OPS_BUF>()                                                /* kv_lookup_table */               \
      .Arg<MSA_OPS_BUF>()                                                /* layer_idx */                     \
      .Arg<MSA_OPS_BUF>()                                                /* sink_weights */                  \
      .Attr<int64_t>("mask")                                                                                  \
      .Attr<int64_t>("window")                                                                                \
      .Attr<double>("scale")                                                                                  \
      .Attr<int64_t>("has_sink")                                                                              \
      .Attr<int64_t>("num_partitions")                                                                        \
      .Attr<int64_t>("block_n")                                                                               \
      .Attr<int64_t>("tile_m")                                                                                \
      .Ret<MSA_OPS_BUF>() /* out */                                                                           \
      .Ret<MSA_OPS_BUF>() /* ws_o */                                                                          \
      .Ret<MSA_OPS_BUF>() /* ws_lse */

#define MSA_OPS_SIG_MHA_PADDED_PAGED(B)                                                                       \
  (B).Arg<MSA_OPS_BUF>()                                                 /* q */                             \
      .Arg<MSA_OPS_BUF>()                                                /* kv_blocks */                     \
      .Arg<MSA_OPS_BUF>()                                                /* cache_lengths */                 \
      .Arg<MSA_OPS_BUF>()                                                /* kv_lookup_table */               \
      .Arg<MSA_OPS_BUF>()                                                /* layer_idx */                     \
      .Arg<MSA_OPS_BUF>()                                                /* valid_lengths */                 \
      .Attr<int64_t>("mask")                                                                                  \
      .Attr<int64_t>("window")                                                                                \
      .Attr<double>("scale")                                                                                  \
      .Attr<int64_t>("num_partitions")                                                                        \
      .Attr<int64_t>("block_n")                                                                               \
      .Attr<int64_t>("tile_m")                                                                                \
      .Ret<MSA_OPS_BUF>() /* out */                                                                           \
      .Ret<MSA_OPS_BUF>() /* ws_o */                                                                          \
      .Ret<MSA_OPS_BUF>() /* ws_lse */

#define MSA_OPS_SIG_MHA_RAGGED_NO_CACHE(B)                                                                    \
  (B).Arg<MSA_OPS_BUF>()                                                 /* q */                             \
      .Arg<MSA_OPS_BUF>()                                                /* k */                             \
      .Arg<MSA_OPS_BUF>()                                                /* v */                             \
      .Arg<MSA_OPS_BUF>()                                                /* input_row_offsets */             \
      .Arg<MSA_OPS_BUF>()                                                /* kv_input_row_offsets */          \
      .Attr<int64_t>("mask")                                                                                  \
      .Attr<int64_t>("window")                                                                                \
      .Attr<double>("scale")                                                                                  \
      .Ret<MSA_OPS_BUF>() /* out */

#define MSA_OPS_SIG_MHA_PADDED_NO_CACHE(B)                                                                    \
  (B).Arg<MSA_OPS_BUF>()                                                 /* q */                             \
      .Arg<MSA_OPS_BUF>()                                                /* k */                             \
      .Arg<MSA_OPS_BUF>()                                                /* v */                             \
      .Arg<MSA_OPS_BUF>()                                                /* valid_length */                  \
      .Attr<int64_t>("mask")                                                                                  \
      .Attr<int64_t>("window")                                                                                \
      .Attr<double>("scale")                                                                                  \
      .Ret<MSA_OPS_BUF>() /* out */

#define MSA_OPS_SIG_MSA_ATTENTION(B)                                                                          \
  (B).Arg<MSA_OPS_BUF>()                                                 /* q */                             \
      .Arg<MSA_OPS_BUF>()                                                /* input_row_offsets */             \
      .Arg<MSA_OPS_BUF>()                                                /* cache_row_offsets */             \
      .Arg<MSA_OPS_BUF>()                                                /* kv_blocks */                     \
      .Arg<MSA_OPS_BUF>()                                                /* cache_lengths */                 \
      .Arg<MSA_OPS_BUF>()                                                /* kv_lookup_table */               \
      .Arg<MSA_OPS_BUF>()                                                /* layer_idx */                     \
      .Arg<MSA_OPS_BUF>()                                                /* d_indices */                     \
      .Attr<double>("scale")                                                                                  \
      .Attr<int64_t>("num_partitions")                                                                        \
      .Attr<int64_t>("max_q")                                                                                 \
      .Ret<MSA_OPS_BUF>() /* out */                                                                           \
      .Ret<MSA_OPS_BUF>() /* ws_o */                                                                          \
      .Ret<MSA_OPS_BUF>() /* ws_lse */

#define MSA_OPS_SIG_MSA_INDEXER(B)                                                                            \
  (B).Arg<MSA_OPS_BUF>()                                                 /* q */                             \
      .Arg<MSA_OPS_BUF>()                                                /* input_row_offsets */             \
      .Arg<MSA_OPS_BUF>()                                                /* k_blocks */                      \
      .Arg<MSA_OPS_BUF>()                                                /* k_cache_lengths */               \
      .Arg<MSA_OPS_BUF>()                                                /* k_lookup_table */                \
      .Arg<MSA_OPS_BUF>()                                                /* layer_idx */                     \
      .Attr<int64_t>("topk")                                                                                  \
      .Attr<int64_t>("init_blocks")                                                                           \
      .Attr<int64_t>("local_blocks")                                                                          \
      .Attr<double>("scale")                                                                                  \
      .Ret<MSA_OPS_BUF>() /* ids */

#define MSA_OPS_SIG_KV_CACHE_STORE(B)                                                                         \
  (B).Arg<MSA_OPS_BUF>()                                                 /* kv_blocks */                     \
      .Arg<MSA_OPS_BUF>()                                                /* k */                             \
      .Arg<MSA_OPS_BUF>()                                                /* v */                             \
      .Arg<MSA_OPS_BUF>()                                                /* input_row_offsets */             \
      .Arg<MSA_OPS_BUF>()                                                /* cache_lengths */                 \
      .Arg<MSA_OPS_BUF>()                                                /* kv_lookup_table */               \
      .Arg<MSA_OPS_BUF>()                                                /* layer_idx */                     \
      .Ret<MSA_OPS_BUF>() /* kv_blocks (aliases operand 0) */

#define MSA_OPS_SIG_KV_CACHE_ROW_OFFSETS(B)                                                                   \
  (B).Arg<MSA_OPS_BUF>()                                                 /* input_row_offsets */             \
      .Arg<MSA_OPS_BUF>()                                                /* cache_lengths */                 \
      .Ret<MSA_OPS_BUF>() /* cache_row_offsets */

#define MSA_OPS_SIG_GET_NUM_PARTITIONS(B)                                                                     \
  (B).Arg<MSA_OPS_BUF>()                                                 /* batch */                         \
      .Arg<MSA_OPS_BUF>()                                                /* max_cache_valid_length */        \
      .Attr<int64_t>("n_kv_heads")                                                                            \
      .Attr<int64_t>("sm_count")                                                                              \
      .Ret<MSA_OPS_BUF>() /* out */

#endif  // MSA_OPS_FFI_SIGNATURES_H_
