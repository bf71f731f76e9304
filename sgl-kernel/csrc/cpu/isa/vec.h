// Minimal fp32 SIMD abstraction, one definition per ISA level.
//
// Included only by kernels_impl.h and cpu_executor_kernels.h, inside an anonymous
// namespace and after the translation unit has switched its target ISA (see
// isa_unit.h), so
// every function here has internal linkage and the right target attribute.
// SGLK_ISA_LEVEL: 0 = portable scalar, 1 = AVX2 + FMA, 2 = AVX-512 (F/BW/VL/DQ).

#if SGLK_ISA_LEVEL == 2

typedef __m512 vf;
static constexpr int VW = 16;

static inline __attribute__((always_inline)) vf v_zero() { return _mm512_setzero_ps(); }
static inline __attribute__((always_inline)) vf v_set1(float x) { return _mm512_set1_ps(x); }
static inline __attribute__((always_inline)) vf v_load(const float* p) { return _mm512_loadu_ps(p); }
static inline __attribute__((always_inline)) void v_store(float* p, vf x) { _mm512_storeu_ps(p, x); }
static inline __attribute__((always_inline)) vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline __attribute__((always_inline)) vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline __attribute__((always_inline)) vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline __attribute__((always_inline)) vf v_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline __attribute__((always_inline)) vf v_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline __attribute__((always_inline)) vf v_max(vf a, vf b) { return _mm512_max_ps(a, b); }
// a * b + c
static inline __attribute__((always_inline)) vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) float v_hsum(vf x) { return _mm512_reduce_add_ps(x); }

static inline __attribute__((always_inline)) vf v_load_bf16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fp32 -> bf16 with round-to-nearest-even; NaN becomes the quiet NaN 0x7fc0.
static inline __attribute__((always_inline)) void v_store_bf16(uint16_t* p, vf x) {
  __m512i u = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// exp(x) (Cephes expf polynomial, ~1 ulp on [-87, 88]); inputs are clamped,
// so very negative arguments give ~1e-38 instead of 0; NaN stays NaN.
static inline __attribute__((always_inline)) vf v_exp(vf x) {
  // clamp with x as the second operand so that a NaN input stays NaN
  x = _mm512_min_ps(_mm512_set1_ps(88.72283f), _mm512_max_ps(_mm512_set1_ps(-87.33654f), x));
  vf fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
  vf y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

#elif SGLK_ISA_LEVEL == 1

typedef __m256 vf;
static constexpr int VW = 8;

static inline __attribute__((always_inline)) vf v_zero() { return _mm256_setzero_ps(); }
static inline __attribute__((always_inline)) vf v_set1(float x) { return _mm256_set1_ps(x); }
static inline __attribute__((always_inline)) vf v_load(const float* p) { return _mm256_loadu_ps(p); }
static inline __attribute__((always_inline)) void v_store(float* p, vf x) { _mm256_storeu_ps(p, x); }
static inline __attribute__((always_inline)) vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline __attribute__((always_inline)) vf v_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline __attribute__((always_inline)) vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline __attribute__((always_inline)) vf v_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline __attribute__((always_inline)) vf v_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline __attribute__((always_inline)) vf v_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline __attribute__((always_inline)) vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) float v_hsum(vf x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) vf v_load_bf16(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline)) void v_store_bf16(uint16_t* p, vf x) {
  __m256i u = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

static inline __attribute__((always_inline)) vf v_exp(vf x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.72283f), _mm256_max_ps(_mm256_set1_ps(-87.33654f), x));
  vf fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  vf y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#else  // portable scalar fallback

typedef float vf;
static constexpr int VW = 1;

static inline vf v_zero() { return 0.0f; }
static inline vf v_set1(float x) { return x; }
static inline vf v_load(const float* p) { return *p; }
static inline void v_store(float* p, vf x) { *p = x; }
static inline vf v_add(vf a, vf b) { return a + b; }
static inline vf v_sub(vf a, vf b) { return a - b; }
static inline vf v_mul(vf a, vf b) { return a * b; }
static inline vf v_div(vf a, vf b) { return a / b; }
// as vminps / vmaxps: the second operand when the first is not smaller / larger (NaN included)
static inline vf v_min(vf a, vf b) { return a < b ? a : b; }
static inline vf v_max(vf a, vf b) { return a > b ? a : b; }
static inline vf v_fma(vf a, vf b, vf c) { return a * b + c; }
static inline float v_hsum(vf x) { return x; }
static inline vf v_load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
static inline void v_store_bf16(uint16_t* p, vf x) { *p = f32_to_bf16(x); }
static inline vf v_exp(vf x) { return __builtin_expf(x); }

#endif
