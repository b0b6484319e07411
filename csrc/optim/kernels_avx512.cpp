// AVX-512 kernels (16 floats per vector). Compiled with AVX-512F (plus AVX2/FMA/F16C, which every
// AVX-512F CPU has) and run only when the CPU reports AVX-512F. Uses AVX-512F instructions only.
#include <immintrin.h>

#include "optim/kernel_impl.h"
#include "optim/kernels.h"

namespace roundpipe::optim::kernels {
namespace {

struct Avx512Isa {
  using F = __m512;
  static constexpr std::int64_t kWidth = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  template <DType G>
  static F load_as(const void* base, std::int64_t i) {
    if constexpr (G == DType::kFloat32) {
      return load(static_cast<const float*>(base) + i);
    } else {
      const __m256i half = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(base) + i));
      if constexpr (G == DType::kBFloat16) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
      } else {
        return _mm512_cvtph_ps(half);
      }
    }
  }
  template <DType O>
  static void store_as(void* base, std::int64_t i, F x) {
    auto* out = reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(base) + i);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    if constexpr (O == DType::kBFloat16) {
      const __m512i bits = _mm512_castps_si512(x);
      const __m512i lowest_kept =
          _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      __m512i rounded = _mm512_srli_epi32(
          _mm512_add_epi32(bits, _mm512_add_epi32(lowest_kept, _mm512_set1_epi32(0x7FFF))), 16);
      rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
      _mm256_storeu_si256(out, _mm512_cvtepi32_epi16(rounded));
    } else {
      const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x),
                                            _mm512_set1_epi32(static_cast<int>(0x80000000u)));
      const __m512 canonical_nan =
          _mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_set1_epi32(0x7FC00000)));
      x = _mm512_mask_mov_ps(x, nan, canonical_nan);
      _mm256_storeu_si256(out, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static bool any_nan(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0; }

  using I = __m512i;
  using M = __mmask16;
  static I bits(F x) { return _mm512_castps_si512(x); }
  static F from_bits(I x) { return _mm512_castsi512_ps(x); }
  static I iset1(std::uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static I iota() {
    return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static I iand(I a, I b) { return _mm512_and_si512(a, b); }
  static I ixor(I a, I b) { return _mm512_xor_si512(a, b); }
  static I ior(I a, I b) { return _mm512_or_si512(a, b); }
  static I imul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I imax(I a, I b) { return _mm512_max_epi32(a, b); }
  static I umax(I a, I b) { return _mm512_max_epu32(a, b); }
  template <int n>
  static I shr(I a) {
    return _mm512_srli_epi32(a, n);
  }
  static M is_nan(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
  static F mul_add(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static I iselect(M mask, I a, I b) { return _mm512_mask_blend_epi32(mask, b, a); }
  static I or_where_negative(I y, I x, I bits) {
    return _mm512_mask_or_epi32(x, _mm512_cmplt_epi32_mask(y, _mm512_setzero_si512()), x, bits);
  }
  template <bool kSigned>
  static F load_half_codes(const void* base, std::int64_t i) {
    const __m128i bytes = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const std::uint8_t*>(base) + i));
    if constexpr (kSigned) {
      // Sign-extended and shifted, the sign lands in bits 15 and 14; bit 14 is cleared.
      const __m256i half = _mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7);
      return _mm512_cvtph_ps(_mm256_and_si256(half, _mm256_set1_epi16(static_cast<short>(0xBFFF))));
    } else {
      return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 7));
    }
  }
  static void store_codes(void* base, std::int64_t i, I x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint8_t*>(base) + i),
                     _mm512_cvtepi32_epi8(x));
  }
  static void store_u16(void* base, std::int64_t i, I x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(base) + i),
                        _mm512_cvtepi32_epi16(x));
  }
  static void store_u16_pair(void* base, std::int64_t i, I a, I b) {
    store_u16(base, i, a);
    store_u16(base, i + kWidth, b);
  }
  static std::uint32_t hmax(I a) { return static_cast<std::uint32_t>(_mm512_reduce_max_epi32(a)); }
  static std::uint32_t humax(I a) { return _mm512_reduce_max_epu32(a); }
};

}  // namespace

void adam_avx512(const AdamCoefficients& c, const AdamBuffers& b, std::int64_t begin,
                 std::int64_t end) {
  adam_scalar(c, b, adam_dispatch<Avx512Isa>(c, b, begin, end), end);
}

bool grad_pass_avx512(GradMode mode, const GradBuffers& b, std::int64_t begin, std::int64_t end) {
  bool finite = true;
  const std::int64_t tail = grad_dispatch<Avx512Isa>(mode, b, begin, end, finite);
  const bool tail_finite = grad_pass_scalar(mode, b, tail, end);
  return finite && tail_finite;
}

}  // namespace roundpipe::optim::kernels
