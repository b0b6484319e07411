// The per-instruction-set entry points behind adam.h's dispatch. Each variant lives in its own
// translation unit compiled with that instruction set's flags; nothing else may be compiled with
// them, so that code for a newer CPU never leaks into paths an older CPU runs.
#pragma once

#include "optim/adam.h"

namespace roundpipe::optim::kernels {

void adam_scalar(const AdamCoefficients& c, const AdamBuffers& b, std::int64_t begin,
                 std::int64_t end);
bool grad_pass_scalar(GradMode mode, const GradBuffers& b, std::int64_t begin, std::int64_t end);
// Blocks [first_block, last_block) of quantize_moment / dequantize_moment (adam.h).
void quantize_blocks(bool is_exp_avg, const float* values, void* codes, float* scales,
                     std::int64_t numel, std::int64_t first_block, std::int64_t last_block,
                     bool given_scales);
void dequantize_blocks(bool is_exp_avg, const void* codes, const float* scales, float* values,
                       std::int64_t numel, std::int64_t first_block, std::int64_t last_block);

#ifdef ROUNDPIPE_HAVE_X86_SIMD
void adam_avx2(const AdamCoefficients& c, const AdamBuffers& b, std::int64_t begin,
               std::int64_t end);
bool grad_pass_avx2(GradMode mode, const GradBuffers& b, std::int64_t begin, std::int64_t end);
void adam_avx512(const AdamCoefficients& c, const AdamBuffers& b, std::int64_t begin,
                 std::int64_t end);
bool grad_pass_avx512(GradMode mode, const GradBuffers& b, std::int64_t begin, std::int64_t end);
#endif

}  // namespace roundpipe::optim::kernels
