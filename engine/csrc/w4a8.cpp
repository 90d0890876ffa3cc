// w4a8: int4 weights (groups of 32 along K, a float16 scale and minimum each), int8
// activations (one scale per 32 values), for matrix-vector products on AVX2 CPUs.
//
// y[m, n] = sum over blocks b of  dw[n,b] * da[m,b] * sum_i q[n,i] * qa[m,i]   (integer dot)
//                               + mw[n,b] * da[m,b] * sum_i qa[m,i]            (the minimum)
//
// Weights are 4-bit codes 0..15, so they are the unsigned operand of vpmaddubsw and
// activations the signed one: pairs of products reach 2 * 15 * 127, far from int16's limit.
// The layout is chosen so that one thread reads its weights as one forward stream:
// rows in groups of 4, and for each pair of blocks the 4 rows' 32 bytes side by side.
// Each output row is computed from its own input row only, by the same instructions in
// the same order whatever M is: a token's logits do not depend on its neighbours.
//
// Registered as torch.ops.specchat.w4a8_linear; compiled on first use (engine/native.py).

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {

constexpr int64_t QK = 32;    // one scale per 32 values along K, weights and activations
constexpr int64_t PAIR = 64;  // the kernel walks K two blocks at a time
constexpr int ROWS = 4;       // output rows packed together

// One activation row, quantized per block of 32 and laid out per pair of blocks:
// qa[pair] = [lo 0..15 of block 2p | lo of 2p+1 | 16..31 of 2p | 16..31 of 2p+1] (64 bytes),
// ds[pair] = [d(2p) x4 | d(2p+1) x4], ss[pair] = [d*sum(q) (2p) x4 | (2p+1) x4].
void quantize_row(const float* x, int8_t* qa, float* ds, float* ss, int64_t K) {
  const __m256 signbit = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(signbit, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i q[4];
    for (int j = 0; j < 4; ++j)
      q[j] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    const __m256i p = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), perm);
    const int64_t pair = b / 2, half = b % 2;
    int8_t* dst = qa + pair * PAIR;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * half), _mm256_castsi256_si128(p));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 + 16 * half), _mm256_extracti128_si256(p, 1));
    const float sd = d * static_cast<float>(_mm_cvtsi128_si32(s4));
    for (int j = 0; j < 4; ++j) {
      ds[pair * 8 + 4 * half + j] = d;
      ss[pair * 8 + 4 * half + j] = sd;
    }
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// MC activation rows against one group of ROWS weight rows.
// w: [np][ROWS][32 bytes]; dw, mw: [np][8] float16 = [block 2p rows 0..3 | block 2p+1 rows 0..3].
template <int MC>
void group_rows(const uint8_t* w, const uint16_t* dw, const uint16_t* mw, int64_t np, const int8_t* qa,
                const float* ds, const float* ss, int64_t K, float* y, int64_t N, int64_t n0,
                int64_t n_valid) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const int64_t astride = K / PAIR;  // pairs per activation row
  __m256 acc[MC][ROWS];
  __m256 macc[MC];
  for (int m = 0; m < MC; ++m) {
    macc[m] = _mm256_setzero_ps();
    for (int r = 0; r < ROWS; ++r) acc[m][r] = _mm256_setzero_ps();
  }
  for (int64_t p = 0; p < np; ++p) {
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dw + p * 8)));
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mw + p * 8)));
    __m256i lo[ROWS], hi[ROWS];
    __m256 sc[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      const __m256i raw =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (p * ROWS + r) * 32));
      lo[r] = _mm256_and_si256(raw, low4);
      hi[r] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      sc[r] = _mm256_permutevar8x32_ps(dv, _mm256_setr_epi32(r, r, r, r, r + 4, r + 4, r + 4, r + 4));
    }
    for (int m = 0; m < MC; ++m) {
      const int8_t* a = qa + (m * astride + p) * PAIR;
      const __m256i alo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
      const __m256i ahi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32));
      const __m256 da = _mm256_loadu_ps(ds + (m * astride + p) * 8);
      for (int r = 0; r < ROWS; ++r) {
        const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[r], alo),
                                             _mm256_maddubs_epi16(hi[r], ahi));
        const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
        acc[m][r] = _mm256_fmadd_ps(f, _mm256_mul_ps(sc[r], da), acc[m][r]);
      }
      macc[m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(ss + (m * astride + p) * 8), macc[m]);
    }
  }
  for (int m = 0; m < MC; ++m) {
    alignas(16) float mo[4];
    _mm_store_ps(mo, _mm_add_ps(_mm256_castps256_ps128(macc[m]), _mm256_extractf128_ps(macc[m], 1)));
    for (int r = 0; r < ROWS && r < n_valid; ++r) y[m * N + n0 + r] = hsum(acc[m][r]) + mo[r];
  }
}

// x [M, K] float32; packed [N/4, K/64, 4, 32] uint8; scales, mins [N/4, K/64, 8] float16 -> [M, N]
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x: contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), np = K / PAIR, groups = packed.size(0);
  TORCH_CHECK(K % PAIR == 0, "in_features must be a multiple of 64");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(1) == np && packed.size(2) == ROWS && packed.size(3) == 32 &&
                  groups * ROWS >= N && groups * ROWS < N + ROWS,
              "packed weights do not match the input");
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == groups * np * 8,
                "scales and minimums must be contiguous float16 [N/4, K/64, 8]");
  auto qa = at::empty({M, K}, x.options().dtype(at::kChar));
  auto ds = at::empty({M, np * 8}, x.options());
  auto ss = at::empty({M, np * 8}, x.options());
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x.data_ptr<float>() + m * K, qa.data_ptr<int8_t>() + m * K,
                 ds.data_ptr<float>() + m * np * 8, ss.data_ptr<float>() + m * np * 8, K);
  auto y = at::empty({M, N}, x.options());
  const uint8_t* W = packed.data_ptr<uint8_t>();
  const auto* D = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* MN = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  const int8_t* QA = qa.data_ptr<int8_t>();
  const float* DS = ds.data_ptr<float>();
  const float* SS = ss.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  // Threads take chunks of ~32 KB of weights from a shared counter instead of a fixed
  // share each: on a machine where another process holds a core for a while, the thread
  // that keeps running does the rest instead of waiting at the end for the stalled one.
  const int64_t chunk = std::max<int64_t>(1, 32768 / (np * ROWS * 32));
  const int64_t chunks = (groups + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(chunks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1))
    for (int64_t g = c * chunk, g1 = std::min(groups, g + chunk); g < g1; ++g) {
      const uint8_t* w = W + g * np * ROWS * 32;
      const uint16_t* dw = D + g * np * 8;
      const uint16_t* mw = MN + g * np * 8;
      const int64_t n0 = g * ROWS, nv = std::min<int64_t>(ROWS, N - n0);
      int64_t m = 0;
      for (; m + 2 <= M; m += 2)
        group_rows<2>(w, dw, mw, np, QA + m * K, DS + m * np * 8, SS + m * np * 8, K, Y + m * N, N, n0, nv);
      for (; m < M; ++m)
        group_rows<1>(w, dw, mw, np, QA + m * K, DS + m * np * 8, SS + m * np * 8, K, Y + m * N, N, n0, nv);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(specchat, m) {
  m.def("w4a8_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, int N) -> Tensor",
        &w4a8_linear);
}
