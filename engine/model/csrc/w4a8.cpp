// w4a8: int4 weights (groups of 32 along K, a float16 scale and minimum each), int8
// activations (one scale per 32 values), for matrix-vector products on AVX2 CPUs.
// A weight group may also span 2^s blocks of 32 (w4a8-g128: four): its scale and minimum
// then serve each of its blocks, the arithmetic per block unchanged, and the weights take
// 0.53 bytes each instead of 0.625 (a one-row product reads that much less).
//
// y[m, n] = sum over blocks b of  dw[n,b] * da[m,b] * sum_i q[n,i] * qa[m,i]   (integer dot)
//                               + mw[n,b] * da[m,b] * sum_i qa[m,i]            (the minimum)
//
// Weights are 4-bit codes 0..15, so they are the unsigned operand of vpmaddubsw and
// activations the signed one. Rows go in groups of 8, interleaved: a 32-byte load holds
// 4 consecutive codes of each of the 8 rows, so one vpmaddubsw against 4 activation
// bytes broadcast to every row gives each row's partial dot in its own lanes. A block's
// 8 products per lane pair stay below int16's limit (8 * 2 * 15 * 127 = 30480), so the
// 32 products of a block are summed in integers, and one float conversion and one fused
// multiply-add per block serve all 8 rows. Nothing is reduced across lanes: output row r
// is lane r.
//
// A block of 8 rows is 128 bytes of codes, with its 8 scales and 8 minimums in two
// parallel arrays; a thread reads each as one forward stream and prefetches the codes
// ahead (the hardware prefetcher stops at page boundaries).
// Each output row is computed from its own input row only, by the same instructions in
// the same order whatever M is: a token's logits do not depend on its neighbours.
//
// On CPUs with AVX512-VNNI a second path (`group_pair_vnni`) runs the same layout: one
// zmm holds the same load of two neighbouring row groups, and vpdpbusd multiplies and sums
// 4 code-activation pairs into each row's int32 lane in one instruction where AVX2 needs
// vpmaddubsw, an add and vpmaddwd; it takes up to 8 activation rows per pass over the
// weights (AVX2: 4), for calls of 2 rows or more (verify blocks, prefill). The block sums
// are the same exact integers and the float steps after them the same instructions in the
// same order, so both paths give the same bits; which one runs is chosen at run time
// (w4a8_set_path, from engine/model/native.py).
//
// On CPUs with AMX-INT8 a third path (`group_pair_amx`) takes calls of many rows
// (prompts, big trees): one tdpbsud gives a block's 16 x 16 int32 sums for up to 16
// activation rows and the same 16 weight rows, the same integers again, and the float
// steps are the VNNI path's.
//
// A prompt's calls (w4a8_set_prompt, from engine/model/native.py `prompt_rows`) may take a
// fourth code where the CPU has AMX-BF16: the weights to bfloat16 once a call, every row
// against them in bfloat16 tiles (`quad_rows_bf16`). Other bits than the three paths', so
// only for rows that need no step's bits; verify blocks and steps never take it.
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
#include <condition_variable>
#include <memory>
#include <mutex>
#include <chrono>
#include <functional>
#include <thread>
#include <pthread.h>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <tuple>
#include <array>
#include <type_traits>
#include <vector>
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t QK = 32;                       // one scale per 32 values along K
constexpr int ROWS = 8;                          // output rows interleaved together
constexpr int64_t BLOCK_BYTES = ROWS * QK / 2;   // one block of 8 rows: 128 bytes of codes
constexpr int64_t PREFETCH = 1024;               // bytes ahead; measured best of 512/1024/2048


// One activation row, quantized per block of 32: codes in order, ds[b] the block's scale
// and ss[b] = ds[b] * the sum of its codes (what the minimums multiply).
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
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qa + b * QK), p);
    ds[b] = d;
    ss[b] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

// 4 activation bytes, repeated for each of the 8 rows.
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// f(std::integral_constant<int, MC>{}, m) for the activation rows m.. of M: passes of MAX
// rows, then the rest in one pass (MC < MAX), so each pass is a kernel compiled for its MC.
template <int MC, class F>
void rest_pass(int64_t left, int64_t m, const F& f) {
  if constexpr (MC >= 1) {
    if (left == MC)
      f(std::integral_constant<int, MC>{}, m);
    else
      rest_pass<MC - 1>(left, m, f);
  }
}

template <int MAX, class F>
void row_passes(int64_t M, const F& f) {
  int64_t m = 0;
  for (; m + MAX <= M; m += MAX) f(std::integral_constant<int, MAX>{}, m);
  rest_pass<MAX - 1>(M - m, m, f);
}

// MC activation rows against one group of 8 weight rows.
// w: [nb][4][8 rows][4 bytes]: in load i of a block, row r's byte j carries code 4i + j in
// its low nibble and code 16 + 4i + j in its high one. dw, mw: [nb][8] float16, row r at r.
template <int MC>
void group_rows(const uint8_t* w, const uint16_t* dw, const uint16_t* mw, int64_t nb, int gshift,
                const int8_t* qa, const float* ds, const float* ss, int64_t K, float* y,
                int64_t N, int64_t n0, int64_t n_valid) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[MC];
  for (int m = 0; m < MC; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * BLOCK_BYTES;
    _mm_prefetch(reinterpret_cast<const char*>(wb + PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb + PREFETCH + 64), _MM_HINT_T0);
    __m256i s[MC];
    for (int m = 0; m < MC; ++m) s[m] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * i));
      const __m256i lo = _mm256_and_si256(raw, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      for (int m = 0; m < MC; ++m) {
        const int8_t* a = qa + m * K + b * QK + 4 * i;
        s[m] = _mm256_add_epi16(s[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(a)),
                                                       _mm256_maddubs_epi16(hi, bcast4(a + 16))));
      }
      // Keep each row's running sum in a register through the block: without this GCC
      // hoists all of a block's vpmaddubsw ahead of the adds and spills their results
      // (prefill, M = 44: 1.25x faster with it).
      for (int m = 0; m < MC; ++m) asm("" : "+x"(s[m]));
    }
    const int64_t gb = (b >> gshift) * 8;  // the weight group's scales: block b's
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dw + gb)));
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mw + gb)));
    for (int m = 0; m < MC; ++m) {
      const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[m], ones));
      acc[m] = _mm256_fmadd_ps(f, _mm256_mul_ps(dv, _mm256_set1_ps(ds[m * nb + b])), acc[m]);
      acc[m] = _mm256_fmadd_ps(mv, _mm256_set1_ps(ss[m * nb + b]), acc[m]);
    }
  }
  for (int m = 0; m < MC; ++m) {
    alignas(32) float out[ROWS];
    _mm256_store_ps(out, acc[m]);
    for (int r = 0; r < ROWS && r < n_valid; ++r) y[m * N + n0 + r] = out[r];
  }
}

#define SPECCHAT_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

// 0: AVX2 (every CPU the kernel runs on), 1: AVX512-VNNI for calls of at least
// g_vnni_min_rows activation rows (g_vnni_min_rows_one where the call runs on one thread).
// Set by w4a8_set_path.
std::atomic<int> g_path{0};
std::atomic<int64_t> g_vnni_min_rows{2};
std::atomic<int64_t> g_vnni_min_rows_one{4};
std::atomic<int64_t> g_amx_min_rows{4};  // path 2: calls of this many rows or more take AMX

// 4 activation bytes, repeated for each of the 16 rows of two groups (vpdpbusd folds it
// into an embedded broadcast).
SPECCHAT_VNNI inline __m512i bcast4x16(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The same load of two row groups side by side: group 0's 8 rows in lanes 0..7, group 1's
// in lanes 8..15.
SPECCHAT_VNNI inline __m512i load_pair(const uint8_t* w0, const uint8_t* w1) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1));
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

SPECCHAT_VNNI inline __m512 scales_pair(const uint16_t* d0, const uint16_t* d1) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d0));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d1));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
}

// A block's float steps for one activation row and two row groups: its 16 int32 sums times
// the weights' scales and the row's block scale d, plus the minimums times s (the scale
// times the row's code sum). The VNNI and AMX paths both run exactly this, group_rows its
// 8-lane twin: the same bits from each.
SPECCHAT_VNNI inline __m512 block_floats(__m512i sum, __m512 dv, __m512 mv, float d, float s,
                                         __m512 acc) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dv, _mm512_set1_ps(d)), acc);
  return _mm512_fmadd_ps(mv, _mm512_set1_ps(s), acc);
}

// MC rows' 16 outputs from n0 into y (rows N apart), the first n_valid of them.
template <int MC>
SPECCHAT_VNNI inline void store_pair_rows(const __m512* acc, float* y, int64_t N, int64_t n0,
                                          int64_t n_valid) {
  for (int m = 0; m < MC; ++m) {
    alignas(64) float out[2 * ROWS];
    _mm512_store_ps(out, acc[m]);
    for (int r = 0; r < 2 * ROWS && r < n_valid; ++r) y[m * N + n0 + r] = out[r];
  }
}

// MC activation rows against two groups of 8 weight rows (16 outputs), AVX512-VNNI.
// The same blocks, integer sums and float steps as group_rows, lane for lane.
template <int MC, int CH = (MC <= 2 ? 4 : MC <= 4 ? 2 : 1)>
SPECCHAT_VNNI void group_pair_vnni(const uint8_t* w0, const uint8_t* w1, const uint16_t* dw0,
                                   const uint16_t* dw1, const uint16_t* mw0, const uint16_t* mw1,
                                   int64_t nb, int gshift, const int8_t* qa, const float* ds, const float* ss,
                                   int64_t K, float* y, int64_t N, int64_t n0, int64_t n_valid) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MC];
  for (int m = 0; m < MC; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb0 = w0 + b * BLOCK_BYTES;
    const uint8_t* wb1 = w1 + b * BLOCK_BYTES;
    _mm_prefetch(reinterpret_cast<const char*>(wb0 + PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb0 + PREFETCH + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb1 + PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb1 + PREFETCH + 64), _MM_HINT_T0);
    // CH independent sums a row (vpdpbusd's 4-5 cycle latency would bind a single chain
    // of 8 when few rows share the pass), added at the block's end: exact integers, so the
    // same block sum whatever CH is.
    __m512i s[MC][CH];
    for (int m = 0; m < MC; ++m)
      for (int c = 0; c < CH; ++c) s[m][c] = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
      const __m512i raw = load_pair(wb0 + 32 * i, wb1 + 32 * i);
      const __m512i lo = _mm512_and_si512(raw, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      for (int m = 0; m < MC; ++m) {
        const int8_t* a = qa + m * K + b * QK + 4 * i;
        __m512i& s_lo = s[m][(2 * i) % CH];
        __m512i& s_hi = s[m][(2 * i + 1) % CH];
        s_lo = _mm512_dpbusd_epi32(s_lo, lo, bcast4x16(a));
        s_hi = _mm512_dpbusd_epi32(s_hi, hi, bcast4x16(a + 16));
      }
    }
    const int64_t gb = (b >> gshift) * 8;
    const __m512 dv = scales_pair(dw0 + gb, dw1 + gb);
    const __m512 mv = scales_pair(mw0 + gb, mw1 + gb);
    for (int m = 0; m < MC; ++m) {
      __m512i sum = s[m][0];
      for (int c = 1; c < CH; ++c) sum = _mm512_add_epi32(sum, s[m][c]);
      acc[m] = block_floats(sum, dv, mv, ds[m * nb + b], ss[m * nb + b], acc[m]);
    }
  }
  store_pair_rows<MC>(acc, y, N, n0, n_valid);
}

// Every activation row against row groups g and g + 1, up to 8 rows a pass over them.
SPECCHAT_VNNI void pair_all_rows(const uint8_t* W, const uint16_t* D, const uint16_t* MN,
                                 int64_t g, int64_t nb, int gshift, const int8_t* QA,
                                 const float* DS, const float* SS, int64_t M, int64_t K, float* Y,
                                 int64_t N) {
  const int64_t sg = nb >> gshift;  // weight groups along K
  const uint8_t* w0 = W + g * nb * BLOCK_BYTES;
  const uint8_t* w1 = w0 + nb * BLOCK_BYTES;
  const uint16_t* d0 = D + g * sg * 8;
  const uint16_t* m0 = MN + g * sg * 8;
  const int64_t n0 = g * ROWS, nv = std::min<int64_t>(2 * ROWS, N - n0);
  auto rows = [&](auto mc, int64_t m) {
    group_pair_vnni<decltype(mc)::value>(w0, w1, d0, d0 + sg * 8, m0, m0 + sg * 8, nb, gshift,
                                         QA + m * K, DS + m * nb, SS + m * nb, K, Y + m * N, N,
                                         n0, nv);
  };
  row_passes<8>(M, rows);
}


// AMX (Intel Sapphire Rapids and later): tdpbsud multiplies a tile of up to 16
// activation rows by 32 codes (signed bytes, straight from the quantized rows) with a
// tile of those 32 codes for 16 weight rows (unsigned bytes, the two row groups'
// nibbles unpacked to 8 rows of 64 bytes: row i holds codes 4i..4i+3 of each weight row,
// load i's low nibbles; row 4 + i the high ones) into 16 x 16 int32 block sums: the
// same exact integers vpdpbusd sums, one instruction for the block of every row of the
// pass. The float steps after them are group_pair_vnni's, lane for lane: the same bits.
#define SPECCHAT_AMX \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

// ldtilecfg's 64 bytes (palette 1): tile t has rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tiles a pass of R activation rows uses: two sets (blocks b and b + 1 in flight
// together, so one block's store and float steps overlap the next one's product).
// Set s: C at 3s (R rows of 16 int32), A at 3s + 1 (R rows of 32 codes), B at 3s + 2.
SPECCHAT_AMX void amx_configure(int R) {
  TileConfig cfg;
  for (int s = 0; s < 2; ++s) {
    cfg.rows[3 * s] = static_cast<uint8_t>(R);
    cfg.colsb[3 * s] = 64;
    cfg.rows[3 * s + 1] = static_cast<uint8_t>(R);
    cfg.colsb[3 * s + 1] = QK;
    cfg.rows[3 * s + 2] = QK / 4;
    cfg.colsb[3 * s + 2] = 64;
  }
  // (GCC's _tile_loadconfig tells the compiler it reads 8 bytes, which lets it drop the
  // stores of the rest: the instruction is written here with the whole struct as input.)
  asm volatile("ldtilecfg %0" ::"m"(cfg));
}

// Block b's codes for the two row groups as B's 8 rows of 64 bytes.
SPECCHAT_AMX inline void unpack_pair(const uint8_t* wb0, const uint8_t* wb1, uint8_t* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m512i raw = load_pair(wb0 + 32 * i, wb1 + 32 * i);
    _mm512_store_si512(reinterpret_cast<__m512i*>(out + 64 * i), _mm512_and_si512(raw, low4));
    _mm512_store_si512(reinterpret_cast<__m512i*>(out + 64 * (4 + i)),
                       _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4));
  }
}

// One block's int32 sums (in `sums`, 16 a row) into MC rows' float accumulators.
template <int MC>
SPECCHAT_AMX inline void amx_block_floats(const int32_t* sums, __m512 dv, __m512 mv, const float* ds,
                                          const float* ss, int64_t nb, int64_t b, __m512* acc) {
  for (int m = 0; m < MC; ++m)
    acc[m] = block_floats(_mm512_load_si512(sums + 16 * m), dv, mv, ds[m * nb + b], ss[m * nb + b],
                          acc[m]);
}

// MC activation rows (tiles configured for R >= MC; qa holds R rows from here, the
// ones past MC padding) against two groups of 8 weight rows, AMX.
template <int MC>
SPECCHAT_AMX void group_pair_amx(const uint8_t* w0, const uint8_t* w1, const uint16_t* dw0,
                                 const uint16_t* dw1, const uint16_t* mw0, const uint16_t* mw1,
                                 int64_t nb, int gshift, const int8_t* qa, const float* ds,
                                 const float* ss, int64_t K, float* y, int64_t N, int64_t n0,
                                 int64_t n_valid) {
  // Blocks b, b + 1 are unpacked an iteration before their tiles load them (a tile load
  // right after the stores that wrote its bytes waits for them: that alone doubled a
  // one-row call), into a ring of 4.
  alignas(64) uint8_t bt[4][8 * 64];
  __m512 acc[MC];
  for (int m = 0; m < MC; ++m) acc[m] = _mm512_setzero_ps();
  // Software-pipelined too: the float steps of blocks b - 2 and b - 1 run after blocks b and
  // b + 1 went to the tile unit (their sums were stored the iteration before), so the
  // products and the stores' way to the vector loads overlap the float work. Each block's
  // float steps still run in block order: the same bits.
  int64_t b = 0;
  int cur = 0;  // sums2[cur] takes this iteration's pair, sums2[cur ^ 1] holds the last one's
  alignas(64) int32_t sums2[2][2][16 * 16];
  if (nb >= 2) {
    unpack_pair(w0, w1, bt[0]);
    unpack_pair(w0 + BLOCK_BYTES, w1 + BLOCK_BYTES, bt[1]);
  }
  for (; b + 1 < nb; b += 2, cur ^= 1) {
    uint8_t* now0 = bt[b & 3];
    uint8_t* now1 = bt[(b + 1) & 3];
    if (b + 3 < nb) {  // the next pair's codes, for the next iteration
      const uint8_t* wa0 = w0 + (b + 2) * BLOCK_BYTES;
      const uint8_t* wa1 = w1 + (b + 2) * BLOCK_BYTES;
      _mm_prefetch(reinterpret_cast<const char*>(wa0 + PREFETCH), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wa0 + PREFETCH + 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wa0 + PREFETCH + 128), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wa0 + PREFETCH + 192), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wa1 + PREFETCH), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wa1 + PREFETCH + 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wa1 + PREFETCH + 128), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wa1 + PREFETCH + 192), _MM_HINT_T0);
      unpack_pair(wa0, wa1, bt[(b + 2) & 3]);
      unpack_pair(wa0 + BLOCK_BYTES, wa1 + BLOCK_BYTES, bt[(b + 3) & 3]);
    }
    asm volatile("" ::: "memory");  // the unpacked codes are in memory before the tile loads
    _tile_loadd(2, now0, 64);
    _tile_loadd(5, now1, 64);
    _tile_loadd(1, qa + b * QK, K);
    _tile_loadd(4, qa + (b + 1) * QK, K);
    _tile_zero(0);
    _tile_zero(3);
    _tile_dpbsud(0, 1, 2);
    _tile_dpbsud(3, 4, 5);
    _tile_stored(0, sums2[cur][0], 64);
    _tile_stored(3, sums2[cur][1], 64);
    if (b >= 2) {
      const int64_t p = b - 2, ga = (p >> gshift) * 8, gc = ((p + 1) >> gshift) * 8;
      amx_block_floats<MC>(sums2[cur ^ 1][0], scales_pair(dw0 + ga, dw1 + ga),
                           scales_pair(mw0 + ga, mw1 + ga), ds, ss, nb, p, acc);
      amx_block_floats<MC>(sums2[cur ^ 1][1], scales_pair(dw0 + gc, dw1 + gc),
                           scales_pair(mw0 + gc, mw1 + gc), ds, ss, nb, p + 1, acc);
    }
  }
  if (b >= 2) {  // the last pair's float steps
    const int64_t p = b - 2, ga = (p >> gshift) * 8, gc = ((p + 1) >> gshift) * 8;
    asm volatile("" ::: "memory");
    amx_block_floats<MC>(sums2[cur ^ 1][0], scales_pair(dw0 + ga, dw1 + ga),
                         scales_pair(mw0 + ga, mw1 + ga), ds, ss, nb, p, acc);
    amx_block_floats<MC>(sums2[cur ^ 1][1], scales_pair(dw0 + gc, dw1 + gc),
                         scales_pair(mw0 + gc, mw1 + gc), ds, ss, nb, p + 1, acc);
  }
  if (b < nb) {  // an odd count of blocks: the last alone
    unpack_pair(w0 + b * BLOCK_BYTES, w1 + b * BLOCK_BYTES, bt[0]);
    asm volatile("" ::: "memory");
    _tile_loadd(2, bt[0], 64);
    _tile_loadd(1, qa + b * QK, K);
    _tile_zero(0);
    _tile_dpbsud(0, 1, 2);
    _tile_stored(0, sums2[0][0], 64);
    const int64_t ga = (b >> gshift) * 8;
    amx_block_floats<MC>(sums2[0][0], scales_pair(dw0 + ga, dw1 + ga), scales_pair(mw0 + ga, mw1 + ga),
                         ds, ss, nb, b, acc);
  }
  store_pair_rows<MC>(acc, y, N, n0, n_valid);
}

// Every activation row against row groups g and g + 1 on AMX: passes of R rows (the
// tiles' height; the last may hold fewer real ones, its tiles reading padding rows).
SPECCHAT_AMX void pair_all_rows_amx(const uint8_t* W, const uint16_t* D, const uint16_t* MN,
                                    int64_t g, int64_t nb, int gshift, const int8_t* QA,
                                    const float* DS, const float* SS, int64_t M, int64_t K,
                                    float* Y, int64_t N, int64_t R) {
  const int64_t sg = nb >> gshift;
  const uint8_t* w0 = W + g * nb * BLOCK_BYTES;
  const uint8_t* w1 = w0 + nb * BLOCK_BYTES;
  const uint16_t* d0 = D + g * sg * 8;
  const uint16_t* m0 = MN + g * sg * 8;
  const int64_t n0 = g * ROWS, nv = std::min<int64_t>(2 * ROWS, N - n0);
  for (int64_t m = 0; m < M; m += R) {
    auto rows = [&](auto mc, int64_t) {
      group_pair_amx<decltype(mc)::value>(w0, w1, d0, d0 + sg * 8, m0, m0 + sg * 8, nb, gshift,
                                          QA + m * K, DS + m * nb, SS + m * nb, K, Y + m * N, N,
                                          n0, nv);
    };
    rest_pass<16>(std::min<int64_t>(R, M - m), 0, rows);
  }
}

SPECCHAT_AMX void amx_release() { _tile_release(); }

// Whether this process may use AMX tiles: Linux hands out the tile state only to a
// process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); without
// it the first tile instruction faults. Asked once; false where the CPU has no AMX-INT8 or
// the kernel refuses.
bool amx_permitted() {
  static const bool ok = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512vnni"))
      return false;
    // AMX-TILE and AMX-INT8: CPUID leaf 7, EDX bits 24 and 25 (read directly: older
    // compilers' __builtin_cpu_supports does not know their names).
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1))
      return false;
#if defined(__linux__)
    constexpr long kReqPerm = 0x1023, kGetPerm = 0x1022, kXtiledata = 18;
    if (syscall(SYS_arch_prctl, kReqPerm, kXtiledata) != 0) return false;
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, kGetPerm, &granted) != 0) return false;
    return ((granted >> kXtiledata) & 1) != 0;
#else
    return false;  // the tile-state request is Linux's; elsewhere the VNNI code runs
#endif
  }();
  return ok;
}

// A prompt's rows on AMX-BF16 (w4a8_set_prompt): a call of many rows that need not give a
// one-token step's bits (the conversation's new tokens, before the first step; a draft's
// read) takes each pair of row groups' weights to bfloat16 once, w = code * scale + min
// rounded to bfloat16, and multiplies every activation row (rounded to bfloat16) by them
// with tdpbf16ps, summed in float32 over the whole row: no float steps a block (a third of
// the int8 tiles' time over a prompt's rows, and the trips of their block sums through
// memory another third). Other bits than a step's, so never a verify block.
#define SPECCHAT_AMX_BF16                                                                  \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16," \
                        "avx2,fma,f16c")))

// Whether this process may use the AMX-BF16 tiles (with AVX512-BF16 and VBMI for the
// weights' conversion): amx_permitted's tile state, and CPUID leaf 7 EDX bit 22 (AMX-BF16),
// ECX bit 1 (VBMI), and leaf 7 subleaf 1 EAX bit 5 (AVX512-BF16).
bool amx_bf16_permitted() {
  static const bool ok = [] {
    if (!amx_permitted()) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((c >> 1) & 1))
      return false;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);
  }();
  return ok;
}

// Tiles: C at 0..3 (16 activation rows by 16 weight rows, float32), A at 4, 5 (16 rows'
// 32 bfloat16 values of a block), B at 6, 7 (a block's 32 values of 16 weight rows as 16
// pairs: row p holds values 2p, 2p + 1 of each weight row).
SPECCHAT_AMX_BF16 void amx_bf16_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  asm volatile("ldtilecfg %0" ::"m"(cfg));
}

// Byte 4i of permutation t of a load of codes (bytes 4n + j hold code 4r + j of weight row
// n, as unpack_pair leaves them; the other bytes of each 32-bit lane come out zero): weight
// row n = 8q + i / 2, code j = 2h + i % 2, for t = 2h + q, so that permutations 2h and 2h + 1
// are B row 2r + h's values, pair by pair, as 32-bit integers.
constexpr std::array<std::array<uint8_t, 64>, 4> kPairOrder = [] {
  std::array<std::array<uint8_t, 64>, 4> idx{};
  for (int t = 0; t < 4; ++t)
    for (int i = 0; i < 16; ++i)
      idx[t][4 * i] = static_cast<uint8_t>(4 * (8 * (t & 1) + i / 2) + 2 * (t >> 1) + (i & 1));
  return idx;
}();
constexpr __mmask64 kLowBytes = 0x1111111111111111ull;

// The codes that permutation idx picks, times their rows' scales plus their minimums.
SPECCHAT_AMX_BF16 inline __m512 value(__m512i idx, __m512i codes, __m512 scale, __m512 min) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(kLowBytes, idx, codes)), scale,
                         min);
}

// One pair of row groups' block b (16 weight rows, 32 values) as a bfloat16 B tile at `tile`.
SPECCHAT_AMX_BF16 inline void pair_block_to_bf16(const uint8_t* w0, const uint8_t* w1,
                                                 const uint16_t* dw0, const uint16_t* dw1,
                                                 const uint16_t* mw0, const uint16_t* mw1,
                                                 int gshift, int64_t b, uint16_t* tile) {
  const __m512i idx0 = _mm512_loadu_si512(kPairOrder[0].data());
  const __m512i idx1 = _mm512_loadu_si512(kPairOrder[1].data());
  const __m512i idx2 = _mm512_loadu_si512(kPairOrder[2].data());
  const __m512i idx3 = _mm512_loadu_si512(kPairOrder[3].data());
  const __m512i half0 = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i half1 = _mm512_add_epi32(half0, _mm512_set1_epi32(8));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int64_t gb = (b >> gshift) * 8;
  const __m512 sv = scales_pair(dw0 + gb, dw1 + gb), mv = scales_pair(mw0 + gb, mw1 + gb);
  const __m512 s0 = _mm512_permutexvar_ps(half0, sv), s1 = _mm512_permutexvar_ps(half1, sv);
  const __m512 m0 = _mm512_permutexvar_ps(half0, mv), m1 = _mm512_permutexvar_ps(half1, mv);
  for (int i = 0; i < 4; ++i) {
    const __m512i raw = load_pair(w0 + b * BLOCK_BYTES + 32 * i, w1 + b * BLOCK_BYTES + 32 * i);
    for (int hi = 0; hi < 2; ++hi) {  // low nibbles: codes 4i.., high: 16 + 4i..
      const int r = 4 * hi + i;
      const __m512i codes = hi ? _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4) : _mm512_and_si512(raw, low4);
      _mm512_storeu_si512(tile + (2 * r) * 32, (__m512i)_mm512_cvtne2ps_pbh(value(idx1, codes, s1, m1),
                                                                           value(idx0, codes, s0, m0)));
      _mm512_storeu_si512(tile + (2 * r + 1) * 32, (__m512i)_mm512_cvtne2ps_pbh(value(idx3, codes, s1, m1),
                                                                               value(idx2, codes, s0, m0)));
    }
  }
}

// Four row groups' weights (two pairs: 32 weight rows), as bfloat16 B tiles a block at a
// time into two buffers of nb tiles. Groups past the last repeat it (outputs not stored).
struct QuadToBf16 {
  const uint8_t* w[4];
  const uint16_t* d[4];
  const uint16_t* mn[4];
  int gshift;
  uint16_t* out[2];

  QuadToBf16(const uint8_t* W, const uint16_t* D, const uint16_t* MN, int64_t q, int64_t groups,
             int64_t nb, int64_t sg, int gs, uint16_t* buf)
      : gshift(gs), out{buf, buf + nb * 512} {
    for (int i = 0; i < 4; ++i) {
      const int64_t g = std::min(4 * q + i, groups - 1);
      w[i] = W + g * nb * BLOCK_BYTES;
      d[i] = D + g * sg * 8;
      mn[i] = MN + g * sg * 8;
    }
  }
  SPECCHAT_AMX_BF16 void block(int64_t b) const {
    pair_block_to_bf16(w[0], w[1], d[0], d[1], mn[0], mn[1], gshift, b, out[0] + b * 512);
    pair_block_to_bf16(w[2], w[3], d[2], d[3], mn[2], mn[3], gshift, b, out[1] + b * 512);
  }
};

// One pass: 32 activation rows from a0 (Two; 16 otherwise) against a quad's B tiles, into
// accumulator tiles 0..3 (0, 1). `beside(b)` runs at each block where `first`.
template <bool Two, class Beside>
SPECCHAT_AMX_BF16 inline void pass_bf16(const uint16_t* a0, uint16_t* const* bt, int64_t nb, int64_t K,
                                        bool first, const Beside& beside) {
  const uint16_t* a1 = a0 + 16 * K;  // 16 rows' blocks, 1 KB each
  const uint16_t* b0 = bt[0];
  const uint16_t* b1 = bt[1];
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (Two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t b = 0; b < nb; ++b) {
    _tile_loadd(4, a0 + b * 512, 64);
    _tile_loadd(6, b0 + b * 512, 64);
    _tile_loadd(7, b1 + b * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (Two) {
      _tile_loadd(5, a1 + b * 512, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    if (first) beside(b);
  }
}

// Every activation row (bfloat16 A tiles [Mp / 16, nb, 16, 32], to_a_tiles, the rows past M
// zeros) against a quad's B tiles bt[0], bt[1]: outputs n0.. (nv of them, up to 32) of rows
// below M into y. Passes of 32 rows hold 4 accumulator tiles, so each A and B tile loaded
// serves two products. `beside(b)` runs at block b of the first pass: the next quad's
// conversion on the vector units while the tile unit multiplies.
template <class Beside>
SPECCHAT_AMX_BF16 void quad_rows_bf16(uint16_t* const* bt, const uint16_t* xa, int64_t nb,
                                      int64_t M, int64_t Mp, float* y, int64_t N, int64_t n0,
                                      int64_t nv, const Beside& beside) {
  alignas(64) float out[16 * 16];
  // Accumulator tile c (0..3: rows half c / 2, weights half c % 2) to rows m0.. of y.
  auto put = [&](int c, int64_t m0) {
    const int64_t rows = std::min<int64_t>(16, M - m0), cols = std::min<int64_t>(16, nv - 16 * (c & 1));
    if (rows <= 0 || cols <= 0) return;
    float* dst = y + m0 * N + n0 + 16 * (c & 1);
    const bool direct = rows == 16 && cols == 16;
    float* to = direct ? dst : out;
    const int64_t stride = direct ? N * 4 : 64;
    switch (c) {
      case 0: _tile_stored(0, to, stride); break;
      case 1: _tile_stored(1, to, stride); break;
      case 2: _tile_stored(2, to, stride); break;
      default: _tile_stored(3, to, stride); break;
    }
    if (!direct)
      for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * N, out + 16 * r, cols * 4);
  };
  const int64_t K = nb * QK;
  for (int64_t m = 0; m < Mp; m += 32) {
    if (m + 32 <= Mp) {
      pass_bf16<true>(xa + m * K, bt, nb, K, m == 0, beside);
      for (int c = 0; c < 4; ++c) put(c, m + 16 * (c >> 1));
    } else {
      pass_bf16<false>(xa + m * K, bt, nb, K, m == 0, beside);
      put(0, m);
      put(1, m);
    }
  }
}

SPECCHAT_AMX_BF16 void amx_bf16_release() { _tile_release(); }

// Choose the path (0 AVX2, 1 AVX512-VNNI from min_rows activation rows up, 2 AMX from
// amx_min_rows up and VNNI below by the same rules) for every later
// call; returns the one before. A single row is bound by reading the weights, and there the
// two streams of a row-group pair read slower than one (Zen 4: 43 against 38 ms for the
// 1.5B's layers), so fewer rows than min_rows take the AVX2 code: the same bits either way.
// From 2 rows up VNNI ties (Zen 4) or wins (Zen 5: a 2-3-row block of the 1.5B ~10% faster).
// On one thread the AVX2 code keeps 2-3 rows (Zen 5: a 2-row block 1.18 against 1.48 steps,
// 3 rows 1.45 against 1.61) and VNNI wins from 4 (5 rows: 1.65 against 2.40), hence
// min_rows_one. Refuses VNNI on a CPU without it rather than fault on its first instruction.
int64_t w4a8_set_path(int64_t path, int64_t min_rows, int64_t min_rows_one, int64_t amx_min_rows) {
  TORCH_CHECK(path >= 0 && path <= 2, "w4a8 path: 0 (AVX2), 1 (AVX512-VNNI) or 2 (AMX)");
  TORCH_CHECK(min_rows >= 1 && min_rows_one >= 1 && amx_min_rows >= 1,
              "w4a8 path: min_rows must be at least 1");
  // AMX first: amx_permitted also asks for AVX512-VNNI (the path's shorter calls take it),
  // and a refusal of path 2 names AMX whatever the CPU lacks.
  TORCH_CHECK(path != 2 || amx_permitted(),
              "AMX: this CPU has no AMX-INT8 (with AVX512-VNNI), or the operating system did "
              "not grant this process the tile state");
  if (path == 1) {
    __builtin_cpu_init();
    TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"),
                "this CPU has no AVX512-VNNI (with AVX512 F, BW and VL)");
  }
  g_vnni_min_rows.store(min_rows);
  g_vnni_min_rows_one.store(min_rows_one);
  g_amx_min_rows.store(amx_min_rows);
  return g_path.exchange(static_cast<int>(path));
}

// The threads a call from this thread runs on: 0 (the default), torch's intra-op count at
// the call; n > 0, n whatever that count is. A prompt's small ops run on one torch thread,
// where waking a second (OMP_WAIT_POLICY=PASSIVE) costs more than it brings, while this
// kernel, whose helpers need no wake, keeps every thread (engine/model/native.py,
// `small_ops_on_one_thread`). Per calling thread, as torch's own count is under OpenMP.
thread_local int64_t t_threads = 0;

int64_t w4a8_set_threads(int64_t threads) {
  TORCH_CHECK(threads >= 0, "threads: 0 (torch's count) or how many");
  const int64_t before = t_threads;
  t_threads = threads;
  return before;
}

int64_t call_threads() { return t_threads > 0 ? t_threads : at::get_num_threads(); }

// Whether a call of M activation rows on this many threads (call_threads) takes the VNNI code.
bool w4a8_takes_vnni(int64_t M) {
  return g_path.load(std::memory_order_relaxed) >= 1 &&
         M >= (call_threads() == 1 ? g_vnni_min_rows_one : g_vnni_min_rows).load();
}

// Whether a call of M rows takes the AMX code (path 2, at least g_amx_min_rows rows).
bool w4a8_takes_amx(int64_t M) {
  return g_path.load(std::memory_order_relaxed) == 2 && M >= g_amx_min_rows.load();
}

// Whether calls from this thread are a prompt's rows (w4a8_set_prompt), which may take the
// AMX-BF16 code from g_bf16_min_rows rows (0: never) where the AMX path is chosen.
thread_local bool t_prompt = false;
std::atomic<int64_t> g_bf16_min_rows{0};

bool w4a8_set_prompt(bool on) {
  const bool before = t_prompt;
  t_prompt = on;
  return before;
}

// From how many rows a prompt's call takes the AMX-BF16 code (0: never); returns the last.
int64_t w4a8_set_prompt_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "prompt rows: 0 (never) or how many");
  TORCH_CHECK(rows == 0 || amx_bf16_permitted(),
              "AMX-BF16: this CPU has no AMX-BF16 (with AVX512-BF16 and VBMI), or the operating "
              "system did not grant this process the tile state");
  return g_bf16_min_rows.exchange(rows);
}

bool w4a8_takes_bf16(int64_t M) {
  const int64_t rows = g_bf16_min_rows.load(std::memory_order_relaxed);
  return t_prompt && rows > 0 && M >= rows && g_path.load(std::memory_order_relaxed) == 2;
}

// work(next) on this thread and on up to `helpers` more, each claiming chunks from the
// shared counter `next` until none is left. Which thread computes an output never changes
// its value.
//
// Why not at::parallel_for: an OpenMP region wakes its sleeping workers (OMP_WAIT_POLICY=
// PASSIVE) and its closing barrier waits for every one of them. On a 2-core VM a wake is
// 40-60 us, and a one-token step makes ~100 of these calls: the 0.5B draft's 896-wide
// projections took 80-94 us on two threads against 36-39 on one. Spinning OpenMP workers
// (GOMP_SPINCOUNT) remove the wake but hold their core: with another process busy on
// one core, steps ran 2-3x slower than passive ones. So the helpers here spin a short
// while after each call, yielding their core to anything runnable, then sleep; and this
// thread never waits for a helper that has not started: it waits only for those that
// joined before it ran out of chunks (one chunk each at most).
// How long a helper spins after a call before it sleeps: SPECCHAT_W4A8_SPIN_US, else 200.
// In the chat on a 2-core Xeon, 200 us against 50: the app 18.2 against 16.7 tok/s, headless
// 18.8 against 16.3 (docs/performance.md, step 31). Shorter spins leave the chat's UI thread
// idle time to run in, but a draft step waits on more wakes.
int64_t spin_us() {
  const char* env = std::getenv("SPECCHAT_W4A8_SPIN_US");
  return env ? std::max<int64_t>(0, std::atoll(env)) : 200;
}

// What the first thread to join a call reads from its counter when no helper will join it.
constexpr int64_t kAlone = INT64_MIN / 2;

// How a call's chunks are dealt (w4a8_set_split): 1, a range a thread (Ranges, the
// default); 0, one counter that every thread takes the next chunk from, as before: kept
// to measure the two against each other in one process (scripts/step_cost.py --splits).
std::atomic<int> g_split{1};

int64_t w4a8_set_split(int64_t split) {
  TORCH_CHECK(split == 0 || split == 1, "split: 0 (one shared counter) or 1 (a range a thread)");
  return g_split.exchange(static_cast<int>(split));
}

class Helpers {
 public:
  // Never destroyed: its threads outlive main. A child made by fork() has none of them
  // (and maybe a lock one held), so it starts a pool of its own.
  static Helpers& get() {
    static std::once_flag once;
    std::call_once(once, [] {
      g_pool = new Helpers();
      pthread_atfork(nullptr, nullptr, [] { g_pool = new Helpers(); });
    });
    return *g_pool;
  }

  template <class F>
  void run(int64_t helpers, const F& work) {
    bool idle = false;
    if (helpers <= 0 || !busy_.compare_exchange_strong(idle, true)) {  // a second caller:
      std::atomic<int64_t> next{kAlone};                                // on its own thread
      work(next);
      return;
    }
    grow(helpers);
    const std::function<void(std::atomic<int64_t>&)> body = [&work](std::atomic<int64_t>& n) { work(n); };
    body_ = &body;
    next_.store(0);
    open_.store(true);
    posted_.fetch_add(1);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      wake_.notify_all();
    }
    work(next_);
    open_.store(false);  // no helper joins after this; wait for those that did
    for (int spins = 0; active_.load() != 0; ++spins) {
      if (spins < 2000) _mm_pause();
      else std::this_thread::yield();
    }
    busy_.store(false);
  }

 private:
  void grow(int64_t helpers) {
    while (static_cast<int64_t>(threads_) < std::min<int64_t>(helpers, 255)) {
      std::thread([this] { loop(); }).detach();
      ++threads_;
    }
  }

  void loop() {
    uint64_t seen = posted_.load();
    for (;;) {
      // Spin a while for the next call (a step's calls come tens of us apart), then sleep.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      for (int i = 0; posted_.load() == seen; ++i) {
        if ((i & 63) == 63) {
          std::this_thread::yield();
          if (std::chrono::steady_clock::now() > until) break;
        }
        _mm_pause();
      }
      if (posted_.load() == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        ++sleepers_;
        wake_.wait(lock, [&] { return posted_.load() != seen; });
        --sleepers_;
      }
      seen = posted_.load();
      active_.fetch_add(1);
      if (open_.load()) (*body_)(next_);
      active_.fetch_sub(1);
    }
  }

  std::atomic<bool> busy_{false}, open_{false};
  std::atomic<uint64_t> posted_{0};
  std::atomic<int> active_{0}, sleepers_{0};
  std::atomic<int64_t> next_{0};
  const std::function<void(std::atomic<int64_t>&)>* body_ = nullptr;
  std::mutex mu_;
  std::condition_variable wake_;
  unsigned threads_ = 0;
  const int64_t spin_us_ = spin_us();
  static Helpers* g_pool;
};
Helpers* Helpers::g_pool = nullptr;

template <class F>
void share(int64_t helpers, const F& work) {
  if (at::in_parallel_region()) helpers = 0;
  Helpers::get().run(helpers, work);
}

// Chunks 0..n split into one contiguous range per thread. A thread takes its own range's
// chunks front to back, then takes other ranges' chunks from their backs. So each thread
// reads one forward stream of weights for most of a call (the hardware prefetcher keeps
// running across its chunks, where chunks dealt in turn from one counter made every
// thread jump a chunk ahead every ~32 KB), and a thread that keeps running still does a
// stalled one's rest. A range is one 64-bit word, front << 32 | back.
class Ranges {
 public:
  Ranges(int64_t n, int64_t parts) : parts_(parts), ranges_(new std::atomic<uint64_t>[parts]) {
    for (int64_t t = 0; t < parts; ++t)
      ranges_[t].store(static_cast<uint64_t>(n * t / parts) << 32 |
                       static_cast<uint64_t>(n * (t + 1) / parts));
  }
  // The next chunk for the thread that got `id` (0, 1, ... in the order threads joined;
  // negative for a caller that runs alone, which takes every range front to back), or -1
  // when every range is done.
  int64_t next(int64_t id) {
    if (id < 0) {
      for (int64_t t = 0; t < parts_; ++t)
        if (const int64_t c = front(t); c >= 0) return c;
      return -1;
    }
    if (id < parts_)
      if (const int64_t c = front(id); c >= 0) return c;
    for (int64_t k = 1; k <= parts_; ++k)
      if (const int64_t c = back((id + k) % parts_); c >= 0) return c;
    return -1;
  }

 private:
  int64_t front(int64_t t) {
    uint64_t v = ranges_[t].load();
    while ((v >> 32) < (v & 0xFFFFFFFFu))
      if (ranges_[t].compare_exchange_weak(v, v + (uint64_t{1} << 32)))
        return static_cast<int64_t>(v >> 32);
    return -1;
  }
  int64_t back(int64_t t) {
    uint64_t v = ranges_[t].load();
    while ((v >> 32) < (v & 0xFFFFFFFFu))
      if (ranges_[t].compare_exchange_weak(v, v - 1))
        return static_cast<int64_t>(v & 0xFFFFFFFFu) - 1;
    return -1;
  }

  const int64_t parts_;
  std::unique_ptr<std::atomic<uint64_t>[]> ranges_;
};


// Rows r0..r1 of x [M, K] float32 as bfloat16 A tiles: value k of row m at ((m / 16) * nb +
// k / 32) * 512 + (m % 16) * 32 + k % 32, rounded to nearest even; rows from M on zeros.
SPECCHAT_AMX_BF16 void to_a_tiles(const float* x, int64_t M, int64_t K, int64_t r0, int64_t r1,
                                  uint16_t* out) {
  const int64_t nb = K / QK;
  for (int64_t m = r0; m < r1; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      uint16_t* dst = out + ((m / 16) * nb + b) * 512 + (m % 16) * QK;
      if (m >= M) {
        std::memset(dst, 0, QK * 2);
        continue;
      }
      const float* src = x + m * K + b * QK;
      _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src)));
    }
}

// A prompt's call on the AMX-BF16 code: each thread takes quads of row groups (32 weight
// rows) from its own range, brings a quad's weights to bfloat16 tiles once (2 nb KB, in its
// cache; the next quad's during the first pass of this one) and runs every activation row
// against them.
at::Tensor w4a8_linear_bf16(const at::Tensor& x, const uint8_t* W, const uint16_t* D,
                            const uint16_t* MN, int64_t N, int64_t groups, int64_t nb, int64_t sg,
                            int gshift) {
  const int64_t M = x.size(0), K = x.size(1), Mp = (M + 15) / 16 * 16;
  // The rows in bfloat16 as A tiles, each 16 rows' block one contiguous 1 KB ([Mp / 16, nb,
  // 16, 32]), converted on every thread, ~256 KB of rows a chunk; only the last tile's
  // padding rows are zeroed (zeroing the whole buffer took ~15 ms of a 141-token prompt).
  auto xa = at::empty({Mp / 16, nb, 16, QK}, x.options().dtype(at::kBFloat16));
  {
    auto* out = reinterpret_cast<uint16_t*>(xa.data_ptr<at::BFloat16>());
    const float* X = x.data_ptr<float>();
    const int64_t per = std::max<int64_t>(1, 65536 / K), chunks = (Mp + per - 1) / per;
    std::atomic<int64_t> next{0};
    share(std::min<int64_t>(chunks, call_threads()) - 1, [&](std::atomic<int64_t>&) {
      for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1))
        to_a_tiles(X, M, K, c * per, std::min(Mp, (c + 1) * per), out);
    });
  }
  auto y = at::empty({M, N}, x.options());
  const auto* XA = reinterpret_cast<const uint16_t*>(xa.data_ptr<at::BFloat16>());
  float* Y = y.data_ptr<float>();
  const int64_t quads = (groups + 3) / 4;  // chunks of 4 row groups, 32 weight rows
  const int64_t threads = std::min<int64_t>(quads, call_threads());
  Ranges ranges(quads, threads);
  share(threads - 1, [&](std::atomic<int64_t>& joined) {
    amx_bf16_configure();
    // Two quads' tiles: the one multiplied, and the next one converted beside it.
    thread_local std::vector<uint16_t> scratch;
    if (static_cast<int64_t>(scratch.size()) < 4 * nb * 512) scratch.resize(4 * nb * 512);
    const int64_t id = joined.fetch_add(1);
    int64_t q = ranges.next(id), slot = 0;
    if (q >= 0) {
      const QuadToBf16 first(W, D, MN, q, groups, nb, sg, gshift, scratch.data());
      for (int64_t b = 0; b < nb; ++b) first.block(b);
    }
    while (q >= 0) {
      const int64_t next = ranges.next(id);
      uint16_t* bt[2] = {scratch.data() + slot * 2 * nb * 512, scratch.data() + (slot * 2 + 1) * nb * 512};
      const QuadToBf16 ahead(W, D, MN, next < 0 ? q : next, groups, nb, sg, gshift,
                             scratch.data() + (slot ^ 1) * 2 * nb * 512);
      const int64_t n0 = 4 * q * ROWS, nv = std::min<int64_t>(4 * ROWS, N - n0);
      quad_rows_bf16(bt, XA, nb, M, Mp, Y, N, n0, nv, [&](int64_t b) {
        if (next >= 0) ahead.block(b);
      });
      q = next;
      slot ^= 1;
    }
    amx_bf16_release();
  });
  return y;
}

// x [M, K] float32; packed [N/8, K/32, 128] uint8; scales, mins [N/8, K/G, 8] float16 -> [M, N],
// G = 32 * 2^s the weight group (read from the scales' shape)
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x: contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK, groups = packed.size(0);
  TORCH_CHECK(K % QK == 0, "in_features must be a multiple of 32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(1) == nb && packed.size(2) == BLOCK_BYTES &&
                  groups * ROWS >= N && groups * ROWS < N + ROWS,
              "packed weights do not match the input");
  TORCH_CHECK(scales.dim() == 3 && scales.size(1) >= 1 && nb % scales.size(1) == 0,
              "scales must be [N/8, K/G, 8] for a weight group G of 32 * 2^s");
  const int64_t sg = scales.size(1);
  int gshift = 0;
  while ((sg << gshift) < nb) ++gshift;
  TORCH_CHECK((sg << gshift) == nb, "a weight group must span a power of two of 32-value blocks");
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == groups * sg * 8,
                "scales and minimums must be contiguous float16 [N/8, K/G, 8]");
  if (w4a8_takes_bf16(M))
    return w4a8_linear_bf16(x, packed.data_ptr<uint8_t>(),
                            reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                            reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()), N, groups,
                            nb, sg, gshift);
  // AMX passes take R rows at a time, the last one's tile reading R: rows past M are zeros.
  const bool amx = w4a8_takes_amx(M);
  const int64_t R = std::min<int64_t>(M, 16), padded = amx ? (M + R - 1) / R * R : M;
  auto qa = at::empty({padded, K}, x.options().dtype(at::kChar));
  if (padded > M) std::memset(qa.data_ptr<int8_t>() + M * K, 0, (padded - M) * K);
  auto ds = at::empty({M, nb}, x.options());
  auto ss = at::empty({M, nb}, x.options());
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x.data_ptr<float>() + m * K, qa.data_ptr<int8_t>() + m * K,
                 ds.data_ptr<float>() + m * nb, ss.data_ptr<float>() + m * nb, K);
  auto y = at::empty({M, N}, x.options());
  const uint8_t* W = packed.data_ptr<uint8_t>();
  const auto* D = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* MN = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  const int8_t* QA = qa.data_ptr<int8_t>();
  const float* DS = ds.data_ptr<float>();
  const float* SS = ss.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  // Threads take chunks of ~32 KB of weights, each from its own range first (Ranges)
  // instead of a fixed share: on a machine where another process holds a core for a
  // while, the thread that keeps running does the rest instead of waiting at the end for
  // the stalled one. The VNNI path takes row groups in pairs, so its chunks hold an even
  // number of them.
  const bool vnni = amx || w4a8_takes_vnni(M);
  int64_t chunk = std::max<int64_t>(1, 32768 / (nb * BLOCK_BYTES));
  if (vnni) chunk += chunk % 2;
  const int64_t chunks = (groups + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(chunks, call_threads());
  const bool split = g_split.load(std::memory_order_relaxed) == 1;
  Ranges ranges(chunks, split ? threads : 1);
  share(threads - 1, [&](std::atomic<int64_t>& joined) {
    if (amx) amx_configure(static_cast<int>(R));  // tile configuration is each thread's own
    const int64_t id = split ? joined.fetch_add(1) : kAlone;  // kAlone: all take range 0's front
    for (int64_t c = ranges.next(id); c >= 0; c = ranges.next(id))
    for (int64_t g = c * chunk, g1 = std::min(groups, g + chunk); g < g1; ++g) {
      if (amx && g + 1 < g1) {
        pair_all_rows_amx(W, D, MN, g, nb, gshift, QA, DS, SS, M, K, Y, N, R);
        ++g;
        continue;
      }
      if (vnni && g + 1 < g1) {
        pair_all_rows(W, D, MN, g, nb, gshift, QA, DS, SS, M, K, Y, N);
        ++g;
        continue;
      }
      const uint8_t* w = W + g * nb * BLOCK_BYTES;
      const uint16_t* dw = D + g * sg * 8;
      const uint16_t* mw = MN + g * sg * 8;
      const int64_t n0 = g * ROWS, nv = std::min<int64_t>(ROWS, N - n0);
      // Activation rows m.. in steps of MC, which share each unpacked load of weights.
      auto rows = [&](auto mc, int64_t m) {
        group_rows<decltype(mc)::value>(w, dw, mw, nb, gshift, QA + m * K, DS + m * nb, SS + m * nb, K,
                                         Y + m * N, N, n0, nv);
      };
      row_passes<4>(M, rows);
    }
    if (amx) amx_release();
  });
  return y;
}

// engine/model/qlinear.py's pack_w4a8_reference (what the tests compare it with, byte
// for byte), in one pass over the weights and in parallel over row groups: per row and
// weight group of G values, min = the least value in float16, scale = (max - min) / 15 in
// float16 (at least 2^-24), code = round-half-even((w - min) / scale) in 0..15. With
// shrinks > 1 the range [min, max] is also tried narrowed about its middle by 5%, 10%, ...
// ((shrinks - 1) * 5% at most), and the one whose codes give the least squared error
// (summed in double; the first of equals) is kept: in a group of 128 one outlier would
// otherwise stretch the steps of 127 values. Rows past N (the last group's padding) get
// zero codes, scales and minimums. No fused multiply-adds, so float32 rounds as torch does.
__attribute__((optimize("fp-contract=off")))
std::tuple<at::Tensor, at::Tensor, at::Tensor> w4a8_pack(const at::Tensor& weight, int64_t group,
                                                         int64_t shrinks) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "weight: contiguous float32 [N, K]");
  TORCH_CHECK(group >= QK && group % QK == 0 && ((group / QK) & (group / QK - 1)) == 0,
              "the weight group must be 32 times a power of two");
  TORCH_CHECK(shrinks >= 1 && shrinks <= 20, "shrinks: 1 (the full range) to 20");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % group == 0, "in_features must be a multiple of the weight group");
  const int64_t nb = K / QK, sg = K / group, groups = (N + ROWS - 1) / ROWS;
  auto packed = at::zeros({groups, nb, BLOCK_BYTES}, weight.options().dtype(at::kByte));
  auto scales = at::zeros({groups, sg, ROWS}, weight.options().dtype(at::kHalf));
  auto mins = at::zeros({groups, sg, ROWS}, weight.options().dtype(at::kHalf));
  const float* W = weight.data_ptr<float>();
  uint8_t* P = packed.data_ptr<uint8_t>();
  at::Half* S = scales.data_ptr<at::Half>();
  at::Half* MN = mins.data_ptr<at::Half>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> code(group), best(group);
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t r = 0; r < ROWS && g * ROWS + r < N; ++r) {
        const float* row = W + (g * ROWS + r) * K;
        for (int64_t q = 0; q < sg; ++q) {
          const float* w = row + q * group;
          float lo = w[0], hi = w[0];
          for (int64_t i = 1; i < group; ++i) {
            lo = std::min(lo, w[i]);
            hi = std::max(hi, w[i]);
          }
          const float mid = (lo + hi) / 2.0f;
          double best_err = 0.0;
          at::Half best_m, best_d;
          for (int64_t j = 0; j < shrinks; ++j) {
            const float keep = 1.0f - 0.05f * static_cast<float>(j);
            const float a = j == 0 ? lo : mid + (lo - mid) * keep;
            const float b = j == 0 ? hi : mid + (hi - mid) * keep;
            const at::Half mh(a);
            const float m = static_cast<float>(mh);
            const at::Half dh(std::max((b - m) / 15.0f, 5.9604644775390625e-8f));  // 2^-24
            const float d = static_cast<float>(dh);
            double err = 0.0;
            for (int64_t i = 0; i < group; ++i) {
              code[i] = static_cast<uint8_t>(std::min(15.0f, std::max(0.0f, std::nearbyint((w[i] - m) / d))));
              if (shrinks > 1) {
                const float e = static_cast<float>(code[i]) * d + m - w[i];
                err += static_cast<double>(e) * static_cast<double>(e);
              }
            }
            if (j == 0 || err < best_err) {
              best_err = err;
              best_m = mh;
              best_d = dh;
              best.swap(code);
            }
          }
          S[(g * sg + q) * ROWS + r] = best_d;
          MN[(g * sg + q) * ROWS + r] = best_m;
          for (int64_t c = 0; c < group / QK; ++c) {
            const uint8_t* cb = best.data() + c * QK;
            uint8_t* out = P + (g * nb + q * (group / QK) + c) * BLOCK_BYTES + 4 * r;
            for (int i = 0; i < 4; ++i)  // load i, this row's bytes j
              for (int j = 0; j < 4; ++j)
                out[32 * i + j] = cb[4 * i + j] | static_cast<uint8_t>(cb[16 + 4 * i + j] << 4);
          }
        }
      }
  });
  return {packed, scales, mins};
}

}  // namespace

TORCH_LIBRARY(specchat, m) {
  m.def("w4a8_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, int N) -> Tensor",
        &w4a8_linear);
  m.def("w4a8_pack(Tensor weight, int group=32, int shrinks=1) -> (Tensor, Tensor, Tensor)",
        &w4a8_pack);
  m.def("w4a8_set_path(int path, int min_rows=2, int min_rows_one=4, int amx_min_rows=4) -> int",
        &w4a8_set_path);
  m.def("w4a8_set_split(int split) -> int", &w4a8_set_split);
  m.def("w4a8_set_threads(int threads) -> int", &w4a8_set_threads);
  m.def("w4a8_takes_vnni(int rows) -> bool", &w4a8_takes_vnni);
  m.def("w4a8_takes_amx(int rows) -> bool", &w4a8_takes_amx);
  m.def("w4a8_amx_permitted() -> bool", &amx_permitted);
  m.def("w4a8_set_prompt(bool on) -> bool", &w4a8_set_prompt);
  m.def("w4a8_set_prompt_rows(int rows) -> int", &w4a8_set_prompt_rows);
  m.def("w4a8_takes_bf16(int rows) -> bool", &w4a8_takes_bf16);
  m.def("w4a8_amx_bf16_permitted() -> bool", &amx_bf16_permitted);
}
