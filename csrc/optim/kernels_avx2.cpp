// AVX2 kernels (8 floats per vector; F16C for fp16). Compiled with -mavx2 -mfma -mf16c and run only
// when the CPU reports AVX2 and FMA. FMA is used only where it rounds as separate operations would
// (see kernel_impl.h).
#include <immintrin.h>

#include "optim/kernel_impl.h"
#include "optim/kernels.h"

namespace roundpipe::optim::kernels {
namespace {

struct Avx2Isa {
  using F = __m256;
  static constexpr std::int64_t kWidth = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  template <DType G>
  static F load_as(const void* base, std::int64_t i) {
    if constexpr (G == DType::kFloat32) {
      return load(static_cast<const float*>(base) + i);
    } else {
      const __m128i half = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(base) + i));
      if constexpr (G == DType::kBFloat16) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
      } else {
        return _mm256_cvtph_ps(half);
      }
    }
  }
  template <DType O>
  static void store_as(void* base, std::int64_t i, F x) {
    auto* out = reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(base) + i);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    if constexpr (O == DType::kBFloat16) {
      const __m256i bits = _mm256_castps_si256(x);
      const __m256i lowest_kept =
          _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
      __m256i rounded = _mm256_srli_epi32(
          _mm256_add_epi32(bits, _mm256_add_epi32(lowest_kept, _mm256_set1_epi32(0x7FFF))), 16);
      rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
      // packus interleaves the two 128-bit lanes; the permute puts the 8 results in order.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xD8);
      _mm_storeu_si128(out, _mm256_castsi256_si128(packed));
    } else {
      // A quiet NaN with no payload converts to the canonical sign|0x7E00 of the scalar path.
      const __m256 canonical_nan = _mm256_or_ps(_mm256_and_ps(x, _mm256_set1_ps(-0.0f)),
                                                _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)));
      x = _mm256_blendv_ps(x, canonical_nan, nan);
      _mm_storeu_si128(out, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static bool any_nan(F a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0; }

  using I = __m256i;
  using M = __m256i;  // all ones where true
  static I bits(F x) { return _mm256_castps_si256(x); }
  static F from_bits(I x) { return _mm256_castsi256_ps(x); }
  static I iset1(std::uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static I iand(I a, I b) { return _mm256_and_si256(a, b); }
  static I ixor(I a, I b) { return _mm256_xor_si256(a, b); }
  static I ior(I a, I b) { return _mm256_or_si256(a, b); }
  static I imul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I imax(I a, I b) { return _mm256_max_epi32(a, b); }
  static I umax(I a, I b) { return _mm256_max_epu32(a, b); }
  template <int n>
  static I shr(I a) {
    return _mm256_srli_epi32(a, n);
  }
  static M is_nan(F a) { return _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
  static F mul_add(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static I iselect(M mask, I a, I b) { return _mm256_blendv_epi8(b, a, mask); }
  static I or_where_negative(I y, I x, I bits) {
    // blendv picks by each lane's sign bit.
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(x),
                                                _mm256_castsi256_ps(_mm256_or_si256(x, bits)),
                                                _mm256_castsi256_ps(y)));
  }
  template <bool kSigned>
  static F load_half_codes(const void* base, std::int64_t i) {
    const __m128i bytes = _mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(static_cast<const std::uint8_t*>(base) + i));
    if constexpr (kSigned) {
      // Sign-extended and shifted, the sign lands in bits 15 and 14; bit 14 is cleared.
      const __m128i half = _mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7);
      return _mm256_cvtph_ps(_mm_and_si128(half, _mm_set1_epi16(static_cast<short>(0xBFFF))));
    } else {
      return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 7));
    }
  }
  static void store_codes(void* base, std::int64_t i, I x) {
    // The low byte of each lane to the first 4 bytes of its 128-bit half, the halves joined.
    const __m256i low_bytes = _mm256_shuffle_epi8(
        x, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8,
                            12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m256i joined =
        _mm256_permutevar8x32_epi32(low_bytes, _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(static_cast<std::uint8_t*>(base) + i),
                     _mm256_castsi256_si128(joined));
  }
  static void store_u16(void* base, std::int64_t i, I x) {
    const __m256i low_halves = _mm256_shuffle_epi8(
        x, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8,
                            9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m256i joined = _mm256_permute4x64_epi64(low_halves, 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(base) + i),
                     _mm256_castsi256_si128(joined));
  }
  static void store_u16_pair(void* base, std::int64_t i, I a, I b) {
    // Lanes hold 0..0xFFFF, so the saturating pack keeps them; it interleaves the 128-bit halves
    // (a's low, b's low, a's high, b's high), which the permute puts in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(base) + i), packed);
  }
  static std::uint32_t hmax(I a) {
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xB1));
    return static_cast<std::uint32_t>(_mm_cvtsi128_si32(m));
  }
  static std::uint32_t humax(I a) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return static_cast<std::uint32_t>(_mm_cvtsi128_si32(m));
  }
};

}  // namespace

void adam_avx2(const AdamCoefficients& c, const AdamBuffers& b, std::int64_t begin,
               std::int64_t end) {
  adam_scalar(c, b, adam_dispatch<Avx2Isa>(c, b, begin, end), end);
}

bool grad_pass_avx2(GradMode mode, const GradBuffers& b, std::int64_t begin, std::int64_t end) {
  bool finite = true;
  const std::int64_t tail = grad_dispatch<Avx2Isa>(mode, b, begin, end, finite);
  const bool tail_finite = grad_pass_scalar(mode, b, tail, end);
  return finite && tail_finite;
}

}  // namespace roundpipe::optim::kernels
