// decoder: the decoder layers of a Llama-family model (Llama, Qwen2, Mistral) for a
// decode step or a short verify block, as one call from Python.
//
// A decode step of the 1.5B target makes ~1,400 small tensor operations around its
// 113 matrix products. Issued from Python through transformers' modules they cost
// ~50 ms of a ~160 ms step on one core (the interpreter's own work, and caches cold
// after every weight stream). Here the same ATen operations run in the same order
// with the same arguments, or a loop of ours that gives their values (the rotary
// embedding) or that the Python path calls too (attention, `attend`), so every value is
// bit-identical to the Python path (tests/unit/test_decoder.py checks it): only the
// interpreter and most of the calls are gone.
//
// What runs here, per layer: RMSNorm; q/k/v projections (one stacked GEMM or three);
// rotary embedding; appending K/V to the cache buffers; attention of each new row
// against the keys up to its own position (`attend` below, which engine/attention.py's
// one-query form also calls; ATen's matmuls where it does not run);
// output projection; residual; RMSNorm; SwiGLU MLP; residual. Embedding, rotary
// tables, final norm and LM head stay in Python.
//
// A verify block's rows must equal the one-token steps' bit for bit (engine/invariance.py),
// and neither MKL's GEMM (a row reduces in another order alone than in a block) nor
// ATen's silu (vector and scalar code round differently) gives that. So a block runs its
// float32 projections through fixed_linear below, whose every output is reduced in one
// order whatever the number of rows (one-token steps too), and its other float
// projections and silu one row at a time, each row a fresh [1, 1, K] tensor through the
// very call a step makes. forward's `rows` says which (Rows); kBatched is transformers'
// modules' way, one call for the block.
//
// Registered as torch.classes.specchat.Decoder, torch.ops.specchat.fixed_linear,
// torch.ops.specchat.fixed_linear_isa, torch.ops.specchat.attend and
// torch.ops.specchat.attend_takes; compiled on first use (engine/native.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/quantized/PackedParams.h>
#include <optional>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SPECCHAT_FIXED_X86 1
#endif

namespace {

// ------------------------------------------------------------------ fixed-order float32 GEMM
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with each output's reduction in one order,
// whatever the number of rows M: lane l of one vector accumulator takes k = l, l + L,
// l + 2L, ... in turn by fused multiply-add (L = 16 on AVX-512, 8 on AVX2; the last
// K mod L values through a masked load), then the lanes are summed by a fixed tree and
// the bias added. Tiling over rows and outputs, and threads (which split the outputs),
// change which outputs are computed together, never how one is: a row alone and the same
// row in a verify block get the same bits, and each weight is read once per block.
// Compiled for AVX-512 and AVX2 side by side and chosen at run time from the CPU; other
// CPUs get "" from fixed_linear_isa and the engine takes a block one row at a time.
#ifdef SPECCHAT_FIXED_X86
template <int MB, int NB>
__attribute__((target("avx512f"))) void tile512(const float* x, int64_t ldx, const float* w,
                                                int64_t k, const float* bias, float* y,
                                                int64_t ldy) {
  __m512 acc[MB][NB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= k; c += 16) {
    __m512 wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(w + j * k + c);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * ldx + c);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (c < k) {
    const __mmask16 m = static_cast<__mmask16>((1u << (k - c)) - 1);
    __m512 wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_ps(m, w + j * k + c);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + i * ldx + c);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      const float sum = _mm512_reduce_add_ps(acc[i][j]);
      y[i * ldy + j] = bias ? sum + bias[j] : sum;
    }
}

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int MB, int NB>
__attribute__((target("avx2,fma"))) void tile256(const float* x, int64_t ldx, const float* w,
                                                 int64_t k, const float* bias, float* y,
                                                 int64_t ldy) {
  __m256 acc[MB][NB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= k; c += 8) {
    __m256 wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(w + j * k + c);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + c);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (c < k) {
    alignas(32) int32_t bits[8];
    for (int l = 0; l < 8; ++l) bits[l] = c + l < k ? -1 : 0;
    const __m256i m = _mm256_load_si256(reinterpret_cast<const __m256i*>(bits));
    __m256 wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_maskload_ps(w + j * k + c, m);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_maskload_ps(x + i * ldx + c, m);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      const float sum = hsum256(acc[i][j]);
      y[i * ldy + j] = bias ? sum + bias[j] : sum;
    }
}

using Tile = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t);

template <int MB, int NB>
Tile pick(bool avx512) {
  return avx512 ? &tile512<MB, NB> : &tile256<MB, NB>;
}

// The tile for mb rows and nb outputs: mb 1..4, nb 1..4; or nb 5..8 with one row (two on
// AVX-512, which has the registers).
Tile tile_for(bool avx512, int64_t mb, int64_t nb) {
  static const Tile t[2][4][8] = {
      {{pick<1, 1>(false), pick<1, 2>(false), pick<1, 3>(false), pick<1, 4>(false),
        pick<1, 5>(false), pick<1, 6>(false), pick<1, 7>(false), pick<1, 8>(false)},
       {pick<2, 1>(false), pick<2, 2>(false), pick<2, 3>(false), pick<2, 4>(false)},
       {pick<3, 1>(false), pick<3, 2>(false), pick<3, 3>(false), pick<3, 4>(false)},
       {pick<4, 1>(false), pick<4, 2>(false), pick<4, 3>(false), pick<4, 4>(false)}},
      {{pick<1, 1>(true), pick<1, 2>(true), pick<1, 3>(true), pick<1, 4>(true),
        pick<1, 5>(true), pick<1, 6>(true), pick<1, 7>(true), pick<1, 8>(true)},
       {pick<2, 1>(true), pick<2, 2>(true), pick<2, 3>(true), pick<2, 4>(true),
        pick<2, 5>(true), pick<2, 6>(true), pick<2, 7>(true), pick<2, 8>(true)},
       {pick<3, 1>(true), pick<3, 2>(true), pick<3, 3>(true), pick<3, 4>(true)},
       {pick<4, 1>(true), pick<4, 2>(true), pick<4, 3>(true), pick<4, 4>(true)}}};
  const Tile tile = t[avx512][mb - 1][nb - 1];
  TORCH_CHECK(tile != nullptr, "no ", mb, "x", nb, " tile");
  return tile;
}
#endif

// f(begin, end) over [0, n) in at most at::get_num_threads() parts of at least `grain`,
// run by this thread and by helpers on torch's inter-op pool (this library is built
// without OpenMP, which at::parallel_for needs). Parts are claimed one at a time, so this
// thread does them all if no helper starts in time (a busy pool, or a call from inside
// it); a helper that starts after the last claim returns without touching f. Which
// thread computes an output never changes its value.
template <class F>
void split(int64_t n, int64_t grain, const F& f) {
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), n / std::max<int64_t>(grain, 1));
  if (parts <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  struct Shared {
    std::mutex mu;
    std::condition_variable idle;
    int64_t next = 0, active = 0;
    std::exception_ptr error;
  };
  auto shared = std::make_shared<Shared>();
  const int64_t chunk = (n + parts - 1) / parts;
  const F* fp = &f;
  auto work = [shared, fp, n, chunk, parts] {
    Shared& s = *shared;
    for (;;) {
      int64_t i;
      {
        std::lock_guard<std::mutex> lock(s.mu);
        if (s.next >= parts) return;
        i = s.next++;
        ++s.active;
      }
      std::exception_ptr e;
      try {
        (*fp)(i * chunk, std::min(n, (i + 1) * chunk));
      } catch (...) {
        e = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(s.mu);
      if (e && !s.error) s.error = e;
      if (--s.active == 0) s.idle.notify_all();
    }
  };
  for (int64_t p = 1; p < parts; ++p) at::launch(work);
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->idle.wait(lock, [&] { return shared->active == 0; });
  if (shared->error) std::rethrow_exception(shared->error);
}

// "avx512", "avx2", or "" where this build or this CPU has neither (then no fixed kernel).
// SPECCHAT_FIXED_ISA=avx2 or =none, read once, asks for less than the CPU has (tests).
std::string fixed_linear_isa() {
#ifdef SPECCHAT_FIXED_X86
  static const std::string isa = [] {
    __builtin_cpu_init();
    const char* env = std::getenv("SPECCHAT_FIXED_ISA");
    const std::string want = env ? env : "";
    if (want == "none") return std::string();
    if (__builtin_cpu_supports("avx512f") && want != "avx2") return std::string("avx512");
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return std::string("avx2");
    return std::string();
  }();
  return isa;
#else
  return std::string();
#endif
}

// x [..., K] float32, weight [N, K] float32, bias [N] or none -> [..., N], each output in
// the fixed order above.
at::Tensor fixed_linear(const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias) {
  const std::string isa = fixed_linear_isa();
  TORCH_CHECK(!isa.empty(), "fixed_linear needs an x86-64 CPU with AVX2 and FMA, or AVX-512");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "fixed_linear takes float32");
  TORCH_CHECK(weight.dim() == 2 && x.size(-1) == weight.size(1), "shapes do not match");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "fixed_linear runs on the CPU");
  const int64_t k = weight.size(1), n = weight.size(0);
  const auto x2 = x.reshape({-1, k}).contiguous();
  const auto w = weight.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == n, "bias must be float32 [N]");
  }
  const int64_t m = x2.size(0);
  auto y = at::empty({m, n}, x2.options());
#ifdef SPECCHAT_FIXED_X86
  const bool avx512 = isa == "avx512";
  const float* xp = x2.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Outputs go NB at a time (more for one or two rows: more weight streams in flight),
  // rows 4 at a time (fewer where the outputs take more registers).
  const int64_t nb_max = m <= 2 && (avx512 || m == 1) ? 8 : 4;
  const int64_t mb_max = nb_max == 8 ? m : 4;
  // Threads split the outputs in whole tiles, ~64k weights at least each.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(k, 1) / nb_max);
  split((n + nb_max - 1) / nb_max, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t j0 = t0 * nb_max; j0 < std::min(n, t1 * nb_max); j0 += nb_max) {
      const int64_t nb = std::min<int64_t>(nb_max, n - j0);
      for (int64_t i0 = 0; i0 < m; i0 += mb_max) {
        const int64_t mb = std::min<int64_t>(mb_max, m - i0);
        tile_for(avx512, mb, nb)(xp + i0 * k, k, wp + j0 * k, k, bp ? bp + j0 : nullptr,
                                 yp + i0 * n + j0, n);
      }
    }
  });
#endif
  auto shape = x.sizes().vec();
  shape.back() = n;
  return y.view(shape);
}

// dense: nn.Linear; the others mirror engine/quant.py's W4A8Linear, Int8WeightOnlyLinear,
// Int4WeightOnlyLinear and Int8DynamicLinear (w8a8).
enum Kind : int64_t { kDense = 0, kW4A8 = 1, kInt8 = 2, kInt4 = 3, kW8A8 = 4 };
using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

// One projection, or several stacked into one GEMM: the result is split into `sizes`
// parts, each with its own bias (undefined when none).
struct Projection {
  int64_t kind = kDense;
  at::Tensor weight;  // dense: [N, K]; w4a8: packed [N/8, K/32, 128]; int8: [N, K]; int4: packed
  at::Tensor scales, mins;  // w4a8: scales, mins; int8: scales; int4: scales and zeros;
                            // w8a8: scales = the weight's row sums
  Packed packed;  // w8a8: fbgemm's weights
  bool reduce_range = false;  // w8a8
  int64_t group_size = 0;  // int4
  at::ScalarType compute = at::kFloat;  // the dtype the quantized kernel takes
  at::Tensor bias;  // dense only: passed to linear
  int64_t in_features = 0, out_features = 0;
  std::vector<int64_t> sizes;
  std::vector<at::Tensor> part_bias;
};

struct Layer {
  at::Tensor norm1, norm2;
  double eps1 = 0, eps2 = 0;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  double scaling = 1;
  std::vector<Projection> qkv, gate_up;  // parts: q, k, v / gate, up
  Projection o, down;
};

at::Tensor w8a8(const at::Tensor& x2, const Projection& p) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("quantized::linear_dynamic", "")
                       .typed<at::Tensor(at::Tensor, const Packed&, bool)>();
  auto [lo, hi] = at::aminmax(x2, 1, true);
  auto span = (hi - lo).clamp_min(1e-30);
  auto u = (x2 - lo) / span;
  auto y = op.call(u, p.packed, p.reduce_range);
  return at::addcmul(lo * p.scales, y, span);
}

at::Tensor w4a8(const at::Tensor& x, const Projection& p) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("specchat::w4a8_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, int64_t)>();
  return op.call(x, p.weight, p.scales, p.mins, p.out_features);
}

// How a block of several rows runs its float projections and silu (engine/invariance.py):
// kBatched as transformers' modules (one call each), kApart one row at a time through
// the calls a one-token step makes, kFixed float32 projections through fixed_linear (a
// one-token step too) and the rest one row at a time.
enum Rows : int64_t { kBatched = 0, kApart = 1, kFixed = 2 };

// Row r of x [1, M, I] as a tensor of its own with a one-token step's strides (I, I, 1).
// clone() alone keeps the narrowed view's (M * I, I, 1), and a 16-bit GEMM's kernel can
// depend on the stride of a size-1 dimension: a float16 row of the tiny test model came
// out otherwise than its step (Xeon with AVX512-FP16 and AMX, MKL 2024.2).
at::Tensor row_alone(const at::Tensor& x, int64_t r) {
  return x.narrow(1, r, 1).clone(at::MemoryFormat::Contiguous);
}

// nn.Linear on x [1, M, K], as `rows` says.
at::Tensor dense(const Projection& p, const at::Tensor& x, int64_t rows) {
  auto bias = p.bias.defined() ? c10::optional<at::Tensor>(p.bias) : c10::nullopt;
  if (rows == kFixed && p.weight.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat)
    return fixed_linear(x, p.weight, bias);
  const int64_t m = x.size(1);
  if (rows == kBatched || m == 1) return at::linear(x, p.weight, bias);
  std::vector<at::Tensor> out;
  out.reserve(m);
  for (int64_t r = 0; r < m; ++r)
    out.push_back(at::linear(row_alone(x, r), p.weight, bias));
  return at::cat(out, 1);
}

// ------------------------------------------------------------------ one-query attention rows
// softmax(q k^T * scaling) v for M query rows of one sequence, row r against the keys
// [0, first + r): a verify block's rows (first = past + 1), or one row (a step, or a tree
// row over its rearranged buffer). ATen's form of it (one_query below: two small batched
// matmuls and a softmax) costs ~40 us a row and layer at 200 keys on a 2-core Zen 4,
// most of it the calls' own overhead: ~1 ms a row of the 1.5B target's 28 layers. Here
// each score is one dot product of 8-lane fused multiply-adds over the head dimension and
// a fixed tree over the lanes; each row's softmax sums its exponentials lane by lane in key
// order; each output is the probabilities' weighted sum of values in key order. None of
// it depends on how many rows share the call, how keys are blocked, or which thread runs
// a key head: a row alone and in a block get the same bits (a step and a verify row).
// AVX2 and FMA, chosen where fixed_linear_isa is (the module path, engine/attention.py,
// calls the same code through torch.ops.specchat.attend, so both paths agree).
#ifdef SPECCHAT_FIXED_X86
// e^x lane by lane (Cephes' expf: 2^n times a degree-7 polynomial of the remainder, ~1
// ulp); x below -87 gives e^-87 (~1.6e-38), far under any softmax's resolution.
__attribute__((target("avx2,fma"))) inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Lanes 0..n-1 all ones (n 0..8).
__attribute__((target("avx2,fma"))) inline __m256i lanes256(int64_t n) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)), index);
}

// 8 accumulators' lane sums as one vector (lane j: acc[j]'s), by a fixed tree.
__attribute__((target("avx2,fma"))) inline __m256 sums8(const __m256* acc) {
  const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 a = _mm256_hadd_ps(s01, s23), b = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// o_j[c, c + 8) += sum over t in [t0, t1) of p_j[t] v_t[c, c + 8) for NJ heads j (p_j at
// p + j * ps, o_j at o + j * os), in key order: each value vector is read once for all NJ
// heads. The sums go on from what o holds (zero before the first keys): the same additions
// in the same order as one pass over all keys.
template <int NJ>
__attribute__((target("avx2,fma"))) void weigh_values(const float* p, int64_t ps, int64_t t0,
                                                      int64_t t1, const float* v, int64_t ts,
                                                      float* o, int64_t os) {
  __m256 acc[NJ];
#pragma GCC unroll 8
  for (int j = 0; j < NJ; ++j) acc[j] = _mm256_loadu_ps(o + j * os);
  for (int64_t t = t0; t < t1; ++t) {
    const __m256 vt = _mm256_loadu_ps(v + t * ts);
#pragma GCC unroll 8
    for (int j = 0; j < NJ; ++j) acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j * ps + t), vt, acc[j]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < NJ; ++j) _mm256_storeu_ps(o + j * os, acc[j]);
}

using Weigh = void (*)(const float*, int64_t, int64_t, int64_t, const float*, int64_t, float*,
                       int64_t);
constexpr Weigh kWeigh[8] = {&weigh_values<1>, &weigh_values<2>, &weigh_values<3>, &weigh_values<4>,
                             &weigh_values<5>, &weigh_values<6>, &weigh_values<7>, &weigh_values<8>};

// From this many keys a row's key heads go to threads of their own. In a step a long
// cache's keys and values come from memory (84 MB for the 1.5B at 1,536 tokens), and two
// cores read them faster: the 1.5B's step at 1,536 cached tokens 18.5 tok/s on one thread's
// attention, 20.8 split (Zen 4, 2 threads); at 512 the same either way. Hot in cache (a
// loop over one layer) a split costs a helper's wake (~40 us), so not below.
constexpr int64_t kSplitKeys = 1024;

struct Heads {
  const float* q;  // [M, H, D], contiguous
  const float* k;  // key head g at k + g * hs, key t at + t * ts
  const float* v;
  float* out;  // [M, H, D]
  int64_t m, h, h_kv, d, first, hs_k, ts_k, hs_v, ts_v;
  float scaling;
};

// Key head g: its G = H / H_kv query heads, every row.
__attribute__((target("avx2,fma"))) void attend_head(const Heads& a, int64_t g) {
  const int64_t G = a.h / a.h_kv, d = a.d, last = a.first + a.m - 1;
  const int64_t pad = (last + 7) / 8 * 8;
  std::vector<float> scores(static_cast<size_t>(a.m * G * pad));
  const float* kg = a.k + g * a.hs_k;
  const float* vg = a.v + g * a.hs_v;
  const __m256 scaling = _mm256_set1_ps(a.scaling);
  // Scores, 8 keys at a time for every row and head (the 8 keys stay in the L1 cache).
  for (int64_t t0 = 0; t0 < last; t0 += 8) {
    for (int64_t r = 0; r < a.m; ++r) {
      const int64_t n = a.first + r;
      if (t0 >= n) continue;
      // Keys past the row's last (in its last group of 8) repeat the last: their lanes are
      // dropped below, and every lane's sum is its own key's alone.
      const float* kt[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) kt[i] = kg + std::min<int64_t>(t0 + i, n - 1) * a.ts_k;
      if (r == 0) {  // the keys two groups on, from memory while these are scored
        const int64_t ahead = t0 + 16;
        for (int64_t i = 0; i < 8 && ahead + i < last; ++i)
          for (int64_t c = 0; c < d; c += 16)
            _mm_prefetch(reinterpret_cast<const char*>(kg + (ahead + i) * a.ts_k + c), _MM_HINT_T0);
      }
      for (int64_t j = 0; j < G; ++j) {
        const float* q = a.q + (r * a.h + g * G + j) * d;
        __m256 acc[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
        for (int64_t c = 0; c < d; c += 8) {
          const __m256 qv = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt[i] + c), acc[i]);
        }
        float* s = scores.data() + (r * G + j) * pad;
        _mm256_storeu_ps(s + t0, _mm256_mul_ps(sums8(acc), scaling));
      }
    }
  }
  for (int64_t r = 0; r < a.m; ++r) {
    const int64_t n = a.first + r;
    const __m256i tail = lanes256(n % 8 == 0 ? 8 : n % 8);
    const int64_t full = (n - 1) / 8 * 8;  // the last (maybe partial) vector starts here
    for (int64_t j = 0; j < G; ++j) {
      float* s = scores.data() + (r * G + j) * pad;
      // softmax over s[0, n): the max (exact in any order), e^(s - max) summed lane by lane
      __m256 mx = _mm256_set1_ps(-INFINITY);
      for (int64_t t = 0; t < full; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t));
      mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + full),
                                              _mm256_castsi256_ps(tail)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const __m256 top = _mm256_set1_ps(_mm_cvtss_f32(m4));
      __m256 total = _mm256_setzero_ps();
      for (int64_t t = 0; t <= full; t += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), top));
        if (t == full) e = _mm256_and_ps(e, _mm256_castsi256_ps(tail));
        _mm256_storeu_ps(s + t, e);
        total = _mm256_add_ps(total, e);
      }
      const __m256 inv = _mm256_set1_ps(1.0f / hsum256(total));
      for (int64_t t = 0; t <= full; t += 8)  // the probabilities
        _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), inv));
    }
    // out = sum_t p_t v_t: 8 lanes of the head dimension at a time, up to 8 heads a pass,
    // over 64 keys at a time (their values stay in the L1 cache for every lane and head:
    // a long cache's values come from memory once, not once a lane).
    const float* p = scores.data() + r * G * pad;
    float* o = a.out + (r * a.h + g * G) * d;
    std::fill(o, o + G * d, 0.0f);
    for (int64_t t0 = 0; t0 < n; t0 += 64) {
      const int64_t t1 = std::min<int64_t>(n, t0 + 64);
      for (int64_t t = t1; t < std::min<int64_t>(n, t1 + 64); ++t)  // the next block's values
        for (int64_t c = 0; c < d; c += 16)
          _mm_prefetch(reinterpret_cast<const char*>(vg + t * a.ts_v + c), _MM_HINT_T0);
      for (int64_t j0 = 0; j0 < G; j0 += 8) {
        const Weigh weigh = kWeigh[std::min<int64_t>(8, G - j0) - 1];
        for (int64_t c = 0; c < d; c += 8)
          weigh(p + j0 * pad, pad, t0, t1, vg + c, a.ts_v, o + j0 * d + c, d);
      }
    }
  }
}
#endif

// Whether attend() takes these tensors: float32 on the CPU, one sequence, a head dimension
// of a multiple of 8, contiguous along it, and a CPU the fixed kernels run on.
// SPECCHAT_ATTEND=aten, read once, keeps ATen's matmuls (to measure one against the other).
bool attend_takes(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value) {
#ifdef SPECCHAT_FIXED_X86
  static const bool aten = [] {
    const char* env = std::getenv("SPECCHAT_ATTEND");
    return env != nullptr && std::string(env) == "aten";
  }();
  return !aten && !fixed_linear_isa().empty() && q.dim() == 4 && key.dim() == 4 && value.dim() == 4 &&
         q.size(0) == 1 && key.size(0) == 1 && q.scalar_type() == at::kFloat &&
         key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat &&
         q.device().is_cpu() && q.size(3) % 8 == 0 && key.stride(3) == 1 &&
         value.stride(3) == 1 && q.size(1) % key.size(1) == 0;
#else
  (void)q, (void)key, (void)value;
  return false;
#endif
}

// q [1, H, M, D]; key, value [1, H_kv, >= first + M - 1, D]; row r sees keys [0, first + r).
// Returns [1, M, H, D]. Call only where attend_takes says so.
at::Tensor attend(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
                  int64_t first, double scaling) {
  const int64_t h = q.size(1), m = q.size(2), d = q.size(3), h_kv = key.size(1);
  TORCH_CHECK(first >= 1 && key.size(2) >= first + m - 1 && value.size(2) >= first + m - 1,
              "attend: too few keys for the rows");
  TORCH_CHECK(key.size(3) == d && value.size(3) == d && value.size(1) == h_kv, "attend: shapes");
  auto qc = q.transpose(1, 2).contiguous();  // [1, M, H, D]
  auto out = at::empty({1, m, h, d}, q.options());
#ifdef SPECCHAT_FIXED_X86
  Heads a{qc.data_ptr<float>(), key.data_ptr<float>(), value.data_ptr<float>(),
          out.data_ptr<float>(), m, h, h_kv, d, first, key.stride(1), key.stride(2),
          value.stride(1), value.stride(2), static_cast<float>(scaling)};
  // Key heads on threads of their own where a row reads many keys (kSplitKeys).
  const int64_t grain = first + m - 1 >= kSplitKeys ? 1 : h_kv;
  split(h_kv, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) attend_head(a, g);
  });
#endif
  return out;
}

// torch.ops.specchat.attend: engine/attention.py's rows, [1, H, M, D] -> [1, M, H, D].
at::Tensor attend_op(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
                     int64_t first, double scaling) {
  TORCH_CHECK(attend_takes(q, key, value), "attend: not for these tensors or this CPU");
  return attend(q, key, value, first, scaling);
}

// Mirrors nn.Linear, or engine/quant.py's W4A8Linear (+ SharedInputGroup's split and biases).
void project(const Projection& p, const at::Tensor& x, std::vector<at::Tensor>& out,
             int64_t rows) {
  at::Tensor y;
  if (p.kind == kDense) {
    y = dense(p, x, rows);
  } else {
    auto shape = x.sizes().vec();
    auto x2 = x.reshape({-1, p.in_features}).to(p.compute).contiguous();
    shape.back() = p.out_features;
    at::Tensor rows;
    if (p.kind == kW4A8)
      rows = w4a8(x2, p);
    else if (p.kind == kW8A8)
      rows = w8a8(x2, p);
    else if (p.kind == kInt8)
      rows = at::_weight_int8pack_mm(x2, p.weight, p.scales);
    else
      rows = at::_weight_int4pack_mm_for_cpu(x2, p.weight, p.group_size, p.scales);
    y = rows.reshape(shape).to(x.scalar_type());
    if (p.bias.defined()) y = y + p.bias;
  }
  if (p.sizes.size() == 1) {
    out.push_back(p.part_bias[0].defined() ? y + p.part_bias[0] : y);
    return;
  }
  auto parts = y.split_with_sizes(p.sizes, -1);
  for (size_t i = 0; i < parts.size(); ++i)
    out.push_back(p.part_bias[i].defined() ? parts[i] + p.part_bias[i] : parts[i]);
}

// silu on x [1, M, I]; apart: one row at a time. ATen's vectorized silu rounds
// differently from its scalar tail, so an element's value depends on where it falls
// in the tensor unless each row is a tensor of its own, as in a one-token step.
at::Tensor silu(const at::Tensor& x, bool apart) {
  const int64_t m = x.size(1);
  if (!apart || m == 1) return at::silu(x);
  std::vector<at::Tensor> out;
  out.reserve(m);
  for (int64_t r = 0; r < m; ++r) out.push_back(at::silu(row_alone(x, r)));
  return at::cat(out, 1);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto h = x.to(at::kFloat);
  auto variance = h.pow(2).mean(-1, true);
  h = h * at::rsqrt(variance + eps);
  return weight * h.to(x.scalar_type());
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

// x * cos + rotate_half(x) * sin for x [1, H, M, D] and cos, sin [1, 1, M, D], float32: the
// values of those five ATen calls (each product rounded, then the sum; negation is exact, and
// the library is built with -ffp-contract=off so no product fuses into the add), in one
// loop. Returned as [1, H, M, D] over [1, M, H, D] memory, which attend reads as it is.
// Other dtypes take the ATen calls.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t h = x.size(1), m = x.size(2), d = x.size(3), half = d / 2;
  if (x.scalar_type() != at::kFloat || cos.scalar_type() != at::kFloat ||
      sin.scalar_type() != at::kFloat || x.stride(3) != 1 || d % 2 != 0 || cos.size(2) != m ||
      sin.size(2) != m || cos.size(3) != d || sin.size(3) != d)
    return x * cos + rotate_half(x) * sin;
  const auto c = cos.contiguous(), s = sin.contiguous();
  auto out = at::empty({1, m, h, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sh = x.stride(1), sr = x.stride(2);
  for (int64_t r = 0; r < m; ++r) {
    const float* cr = cp + r * d;
    const float* srow = sp + r * d;
    for (int64_t j = 0; j < h; ++j) {
      const float* xi = xp + j * sh + r * sr;
      float* oi = op + (r * h + j) * d;
      for (int64_t i = 0; i < half; ++i) {
        const float a = xi[i] * cr[i];
        const float b = -xi[i + half] * srow[i];
        oi[i] = a + b;
      }
      for (int64_t i = half; i < d; ++i) {
        const float a = xi[i] * cr[i];
        const float b = xi[i - half] * srow[i];
        oi[i] = a + b;
      }
    }
  }
  return out.transpose(1, 2);
}

// Up to this many keys a query row is scored on one thread (engine/attention.py's
// ONE_THREAD_KEYS, which says why).
constexpr int64_t kOneThreadKeys = 2048;

// Elementwise work of up to this many rows (verify blocks: engine/attention.py's
// MAX_ROWWISE) runs on one thread: above 32,768 values ATen splits it over the threads, and
// waking the second costs more than the SiLU and product of a few rows (1.5B target, 5 rows:
// 5 ms of a 78 ms verify pass went to waking it; Zen 4, 2 threads, OMP_WAIT_POLICY=PASSIVE).
constexpr int64_t kOneThreadRows = 32;

// While alive, ATen ops run on one thread; the count before is put back after.
struct OneThread {
  const int before = at::get_num_threads();
  OneThread() {
    if (before > 1) at::set_num_threads(1);
  }
  ~OneThread() {
    if (before > 1) at::set_num_threads(before);
  }
};

// One query row [1, H, 1, D] against T keys [1, Hkv, T, D]: engine/attention.py's _one_query,
// on one thread up to kOneThreadKeys keys, as there.
at::Tensor one_query(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     double scaling) {
  std::optional<OneThread> one;
  if (key.size(2) <= kOneThreadKeys) one.emplace();
  const int64_t h = query.size(1), d = query.size(3), h_kv = key.size(1);
  auto q = query.reshape({1, h_kv, h / h_kv, d});
  auto scores = at::matmul(q, key.transpose(-1, -2)) * scaling;
  auto probs = at::softmax(scores, -1, at::kFloat).to(value.scalar_type());
  return at::matmul(probs, value).reshape({1, 1, h, d});
}

// One query row [1, H, 1, D] against all of key/value's T keys, [1, 1, H, D]: attend where
// it takes them, else ATen's one_query (the same choice the module path makes).
at::Tensor attend_or_not(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         double scaling) {
  if (attend_takes(query, key, value)) return attend(query, key, value, key.size(2), scaling);
  return one_query(query, key, value, scaling);
}

// A draft tree's rows (forward's `parents`): for each row, its path from row 0 (the rows
// it attends to after the cache, itself last), or an empty path where that is rows 0..r,
// as in a chain (then the row is scored as a chain's). Empty for no tree.
std::vector<std::vector<int64_t>> tree_paths(const std::vector<int64_t>& parents, int64_t m) {
  std::vector<std::vector<int64_t>> paths;
  if (parents.empty()) return paths;
  TORCH_CHECK(static_cast<int64_t>(parents.size()) == m, "one parent per row");
  TORCH_CHECK(parents[0] == -1, "row 0 follows the cache");
  paths.resize(m);
  std::vector<std::vector<int64_t>> full(m);
  full[0] = {0};
  for (int64_t r = 1; r < m; ++r) {
    const int64_t p = parents[r];
    TORCH_CHECK(p >= 0 && p < r, "a row's parent comes before it");
    full[r] = full[p];
    full[r].push_back(r);
    bool chain = true;
    for (size_t j = 0; j < full[r].size(); ++j) chain = chain && full[r][j] == static_cast<int64_t>(j);
    if (!chain) paths[r] = full[r];
  }
  return paths;
}

struct Decoder : torch::CustomClassHolder {
  std::vector<Layer> layers;
  Projection* last_ = nullptr;  // the projection add_projection added last; attach_packed's

  void add_layer(at::Tensor norm1, double eps1, at::Tensor norm2, double eps2, int64_t heads,
                 int64_t kv_heads, int64_t head_dim, double scaling) {
    Layer l;
    l.norm1 = std::move(norm1);
    l.norm2 = std::move(norm2);
    l.eps1 = eps1;
    l.eps2 = eps2;
    l.heads = heads;
    l.kv_heads = kv_heads;
    l.head_dim = head_dim;
    l.scaling = scaling;
    layers.push_back(std::move(l));
    last_ = nullptr;  // pointed into a layer the push may have moved
  }

  // stage: 0 q/k/v, 1 o, 2 gate/up, 3 down. tensors: dense [weight], w4a8 [packed, scales,
  // mins], int8 [weight, scales], int4 [packed, scales and zeros]; group_size: int4's;
  // bias: [] or [bias]; part_bias: one per size, an empty tensor where none.
  void add_projection(int64_t stage, int64_t kind, std::vector<at::Tensor> tensors,
                      int64_t group_size, std::vector<at::Tensor> bias, int64_t in_features,
                      int64_t out_features, std::vector<int64_t> sizes,
                      std::vector<at::Tensor> part_bias) {
    TORCH_CHECK(!layers.empty(), "add_layer first");
    TORCH_CHECK(kind >= kDense && kind <= kW8A8, "unknown projection kind ", kind);
    const size_t expected[] = {1, 3, 2, 2, 1};  // w8a8: the row sums; then attach_packed
    TORCH_CHECK(tensors.size() == expected[kind], "wrong number of weight tensors");
    TORCH_CHECK(sizes.size() == part_bias.size() && !sizes.empty(), "one bias slot per part");
    Projection p;
    p.kind = kind;
    p.weight = tensors[0];
    if (kind == kW8A8) p.scales = tensors[0];
    if (kind != kDense && kind != kW8A8) p.scales = tensors[1];
    if (kind == kW4A8) p.mins = tensors[2];
    if (kind == kInt8 || kind == kInt4) p.compute = at::kBFloat16;
    p.group_size = group_size;
    if (!bias.empty()) p.bias = bias[0];
    p.in_features = in_features;
    p.out_features = out_features;
    p.sizes = std::move(sizes);
    for (auto& b : part_bias) p.part_bias.push_back(b.numel() ? b : at::Tensor());
    Layer& l = layers.back();
    switch (stage) {
      case 0: l.qkv.push_back(std::move(p)); last_ = &l.qkv.back(); break;
      case 1: l.o = std::move(p); last_ = &l.o; break;
      case 2: l.gate_up.push_back(std::move(p)); last_ = &l.gate_up.back(); break;
      case 3: l.down = std::move(p); last_ = &l.down; break;
      default: TORCH_CHECK(false, "unknown stage ", stage);
    }
  }

  // fbgemm's packed weights for the w8a8 projection added last.
  void attach_packed(Packed packed, bool reduce_range) {
    TORCH_CHECK(last_ != nullptr && last_->kind == kW8A8 && !last_->packed,
                "attach_packed follows add_projection of a w8a8 projection");
    last_->packed = std::move(packed);
    last_->reduce_range = reduce_range;
  }

  // Layers first..first+L-1 for M new rows, written to cache slots past..past+M-1. h
  // [1, M, H] the rows' hidden states entering layer `first`; cos, sin [1, M, D]; keys[i],
  // values[i] the cache buffers [1, Hkv, capacity, D] of layer first+i, holding `past`
  // positions and with room for M more. rows: how float projections and silu take the
  // rows (Rows). parents: empty for a chain (row r sees rows 0..r), else a draft tree:
  // row r's parent row (-1 for row 0, which follows the cache; a parent comes before its
  // child), and row r sees the cache and its path from row 0 (see tree_paths). Writes the
  // new K/V and returns the last layer's output [1, M, H].
  at::Tensor forward(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys,
                     std::vector<at::Tensor> values, int64_t past, int64_t first,
                     int64_t rows, std::vector<int64_t> parents) {
    TORCH_CHECK(keys.size() == values.size() && first >= 0 &&
                    first + static_cast<int64_t>(keys.size()) <= static_cast<int64_t>(layers.size()),
                "one cache buffer per layer run");
    TORCH_CHECK(rows >= kBatched && rows <= kFixed, "unknown rows mode ", rows);
    const int64_t m = h.size(1), end = past + m;
    const auto paths = tree_paths(parents, m);
    cos = cos.unsqueeze(1);  // [1, 1, M, D]
    sin = sin.unsqueeze(1);
    std::vector<at::Tensor> parts;
    for (size_t i = 0; i < keys.size(); ++i) {
      const Layer& l = layers[first + i];
      TORCH_CHECK(keys[i].size(2) >= end && values[i].size(2) >= end, "cache buffer too small");
      // attention
      auto x = rms_norm(h, l.norm1, l.eps1);
      parts.clear();
      for (const auto& p : l.qkv) project(p, x, parts, rows);
      auto q = parts[0].view({1, m, -1, l.head_dim}).transpose(1, 2);  // [1, H, M, D]
      auto k = parts[1].view({1, m, -1, l.head_dim}).transpose(1, 2);  // [1, Hkv, M, D]
      auto v = parts[2].view({1, m, -1, l.head_dim}).transpose(1, 2);
      q = rotary(q, cos, sin);
      k = rotary(k, cos, sin);
      keys[i].narrow(2, past, m).copy_(k);
      values[i].narrow(2, past, m).copy_(v);
      auto key = keys[i].narrow(2, 0, end);
      auto value = values[i].narrow(2, 0, end);
      at::Tensor att;
      if (paths.empty() && attend_takes(q, key, value)) {
        att = attend(q, key, value, past + 1, l.scaling);  // every row of a chain at once
      } else if (m == 1) {
        att = one_query(q, key, value, l.scaling);
      } else {
        std::vector<at::Tensor> rows;
        at::Tensor block_k, block_v;  // the block's own K/V, while tree rows borrow slots
        for (int64_t r = 0; r < m; ++r) {
          if (paths.empty() || paths[r].empty()) {  // row r sees the keys up to its own slot
            const int64_t upto = end - (m - 1 - r);
            rows.push_back(attend_or_not(q.slice(2, r, r + 1), key.narrow(2, 0, upto),
                                         value.narrow(2, 0, upto), l.scaling));
            continue;
          }
          // A tree row off the chain: its path's K/V go to the slots a chain would hold
          // them in, so it is scored over the very buffer a one-token step at its position
          // reads (the same bits); then the block's K/V are put back.
          if (!block_k.defined()) {
            block_k = keys[i].narrow(2, past, m).clone();
            block_v = values[i].narrow(2, past, m).clone();
          }
          const auto& path = paths[r];
          const int64_t n = static_cast<int64_t>(path.size());
          auto index = at::tensor(path, at::kLong);
          keys[i].narrow(2, past, n).copy_(block_k.index_select(2, index));
          values[i].narrow(2, past, n).copy_(block_v.index_select(2, index));
          rows.push_back(attend_or_not(q.slice(2, r, r + 1), key.narrow(2, 0, past + n),
                                       value.narrow(2, 0, past + n), l.scaling));
          keys[i].narrow(2, past, n).copy_(block_k.narrow(2, 0, n));
          values[i].narrow(2, past, n).copy_(block_v.narrow(2, 0, n));
        }
        att = at::cat(rows, 1);
      }
      att = att.reshape({1, m, -1}).contiguous();
      parts.clear();
      project(l.o, att, parts, rows);
      h = h + parts[0];
      // MLP
      x = rms_norm(h, l.norm2, l.eps2);
      parts.clear();
      for (const auto& p : l.gate_up) project(p, x, parts, rows);
      at::Tensor act;
      {  // a verify block's m x intermediate values would wake a second thread (OneThread)
        std::optional<OneThread> one;
        if (m <= kOneThreadRows) one.emplace();
        act = silu(parts[0], rows != kBatched) * parts[1];
      }
      parts.clear();
      project(l.down, act, parts, rows);
      h = h + parts[0];
    }
    return h;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(specchat, m) {
  m.def("fixed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &fixed_linear);
  m.def("fixed_linear_isa() -> str", &fixed_linear_isa);
  m.def("attend(Tensor q, Tensor key, Tensor value, int first, float scaling) -> Tensor",
        &attend_op);
  m.def("attend_takes(Tensor q, Tensor key, Tensor value) -> bool", &attend_takes);
  m.class_<Decoder>("Decoder")
      .def(torch::init<>())
      .def("add_layer", &Decoder::add_layer)
      .def("add_projection", &Decoder::add_projection)
      .def("attach_packed", &Decoder::attach_packed)
      .def("forward", &Decoder::forward);
}
