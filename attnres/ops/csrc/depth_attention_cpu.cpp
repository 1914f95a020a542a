// Depth attention on CPU, fused: the core pair of attnres/ops/torch_fused.py (the same math,
// arguments and saved statistics; its module docstring has the per-token formulas) as one
// loop over tokens each way. Per token the n source rows (n * D values, a few KB) stay in L1
// while the logits, softmax, weighted sums and, backward, every gradient are formed, so each
// source is read from memory once per call and each gradient written once. The plain-PyTorch
// formulation makes a pass over memory per operation instead (dozens per call); on narrow
// models (D ~ 100) those passes, not the arithmetic, are the cost of AttnRes over a standard
// residual (experiments/BENCHMARKS.md, "Small models on CPU").
//
// Tokens go in tiles of kTile: the softmax of a tile is vectorised across its tokens (exp from
// arithmetic, `exp_lanes`); the dot products are formed for W tokens of a source at a time and
// the weighted sums and gradients a block of columns at a time in registers, so that what a
// row costs beyond its bytes is paid once per group of rows ("rows in groups" below).
// Backward, a source's gradient is written fresh or added into a buffer the caller passes
// (`accumulate`: the gradient sink of cpu_fused.py, one buffer per source over all the calls
// that read it).
//
// A fused output norm (`out_norm`, the weight w, with its own eps: the next sublayer's pre-norm)
// turns output 0 into y = RMSNorm(h_0) w, formed from the unrounded h_0 while its row is in L1,
// with or without a prefix and beside any number of further queries (phase 1 and phase 2 of the
// strategies' two-phase path: the sublayer whose query is first reads y, not h). h_0 and its
// inverse RMS are kept for the backward, which turns y's cotangent into h_0's in the same loop:
// no pass over memory of its own either way.
//
// Built on first use by attnres/ops/cpu_fused.py (torch.utils.cpp_extension); float32 and
// float64, the compute dtype of the sources (half sources take the PyTorch path). Tokens are
// split over ATen's intra-op threads; the query and norm-weight gradients are summed per
// thread in float64 and added up at the end.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <limits>
#include <vector>

namespace {

using at::Tensor;
constexpr int64_t kGrain = 32;  // tokens per task: a few hundred KB of sources at D ~ 100

// Row chunks as values: W lanes of one vector register of the target (GCC/Clang vector
// extensions: 64 bytes with AVX-512, 32 with AVX/AVX2, 16 with SSE/NEON), a D that W does not
// divide finishing with one-lane chunks (a plain T). The dot products sum in such values, W
// partial sums per row added up at the end: one running sum is a chain of dependent
// multiply-adds (about 4 cycles each), and at D ~ 100 that latency, not the loads, was what a
// row's dot products cost. Wider than a register, the vectors are not kept in registers: GCC
// lowered 64-byte values on an AVX2 CPU to halves passed through the stack and reassembled from
// 64-bit pieces, and the kernel ran 2.5x to 3.4x slower at D 32 to 256 (perf annotate, 2026-12-06).
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif
template <typename T>
struct Lanes {
  typedef T type __attribute__((vector_size(kVecBytes)));
};
template <typename T>
using vec = typename Lanes<T>::type;

template <typename V, typename T>
inline V load(const T* p) {
  V x;
  std::memcpy(&x, p, sizeof(V));
  return x;
}
template <typename V, typename T>
inline void store(T* p, const V& x) {
  std::memcpy(p, &x, sizeof(V));
}

// body(V{}, j) for each chunk [j, j + lanes of V) of a row of d values
template <typename T, typename F>
inline void chunks(int64_t d, F&& body) {
  constexpr int64_t W = sizeof(vec<T>) / sizeof(T);
  int64_t j = 0;
  for (; j + W <= d; j += W) body(vec<T>{}, j);
  for (; j < d; ++j) body(T{}, j);
}

// the sum of a chunk's lanes as a tree of halves (log2 W adds, in registers): adding the lanes
// one by one is a chain of W - 1 dependent adds, at D ~ 100 longer than the dot product it ends
// (a compiler without __builtin_shufflevector, GCC before 12, takes that chain)
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define ATTNRES_HALVES 1
#endif
#endif
#ifdef ATTNRES_HALVES
template <typename V, std::size_t... I>
inline auto lower_half(const V& x, std::index_sequence<I...>) {
  return __builtin_shufflevector(x, x, I...);
}
template <typename V, std::size_t... I>
inline auto upper_half(const V& x, std::index_sequence<I...>) {
  return __builtin_shufflevector(x, x, (I + sizeof...(I))...);
}
#endif
template <typename V>
inline auto hsum(const V& x) {
  if constexpr (std::is_arithmetic_v<V>) {
    return x;
  } else {
    constexpr std::size_t W = sizeof(V) / sizeof(x[0]);
#ifdef ATTNRES_HALVES
    if constexpr (W > 2) {
      constexpr auto half = std::make_index_sequence<W / 2>{};
      return hsum(lower_half(x, half) + upper_half(x, half));
    }
#endif
    auto s = x[0];
    for (std::size_t l = 1; l < W; ++l) s += x[l];
    return s;
  }
}

// out[k] = v . b[k] for the G rows b[0..G-1], and with Self out[G] = v . v, in one pass over v
template <int G, bool Self = false, typename T>
inline void dots(const T* v, const T* const* b, int64_t d, T* out) {
  vec<T> s0{}, s1{}, s2{}, s3{}, sv{};
  T t0 = 0, t1 = 0, t2 = 0, t3 = 0, tv = 0;
  chunks<T>(d, [&](auto lanes, int64_t j) {
    using V = decltype(lanes);
    const V x = load<V>(v + j);
    if constexpr (std::is_arithmetic_v<V>) {
      t0 += x * b[0][j];
      if constexpr (G > 1) t1 += x * b[1][j];
      if constexpr (G > 2) t2 += x * b[2][j];
      if constexpr (G > 3) t3 += x * b[3][j];
      if constexpr (Self) tv += x * x;
    } else {
      s0 += x * load<V>(b[0] + j);
      if constexpr (G > 1) s1 += x * load<V>(b[1] + j);
      if constexpr (G > 2) s2 += x * load<V>(b[2] + j);
      if constexpr (G > 3) s3 += x * load<V>(b[3] + j);
      if constexpr (Self) sv += x * x;
    }
  });
  out[0] = hsum(s0) + t0;
  if constexpr (G > 1) out[1] = hsum(s1) + t1;
  if constexpr (G > 2) out[2] = hsum(s2) + t2;
  if constexpr (G > 3) out[3] = hsum(s3) + t3;
  if constexpr (Self) out[G] = hsum(sv) + tv;
}

template <typename T>
inline T dot(const T* a, const T* b, int64_t d) {
  T out;
  dots<1>(a, &b, d, &out);
  return out;
}

// 1 / sqrt(mean(v^2) + eps) from ss = v . v, exact for any finite row: rescaled by max|v| when
// a square overflowed (as torch_fused.inv_rms does).
template <typename T>
inline T row_inv_rms(const T* v, int64_t d, double eps, T ss) {
  if (std::isfinite(ss)) return T(1) / std::sqrt(ss / T(d) + T(eps));
  T c = 1;
  for (int64_t j = 0; j < d; ++j) c = std::max(c, std::abs(v[j]));
  T s = 0;
  for (int64_t j = 0; j < d; ++j) s += (v[j] / c) * (v[j] / c);
  return T(1) / std::sqrt(s / T(d) + T(eps) / c / c) / c;
}

std::vector<const void*> pointers(const std::vector<Tensor>& ts) {
  std::vector<const void*> p;
  p.reserve(ts.size());
  for (const auto& t : ts) p.push_back(t.defined() ? t.data_ptr() : nullptr);  // undefined: an absent cotangent
  return p;
}

// Sources, prefixes and cotangents come as (..., D) tensors of one shape (B, T, D in a
// Transformer): M = numel / D rows, read in place (contiguous, of the compute dtype).
void check_rows(const std::vector<Tensor>& ts, at::IntArrayRef shape, at::ScalarType dt, const char* what) {
  for (const auto& t : ts) {
    TORCH_CHECK(t.sizes() == shape, what, ": expected shape ", shape, ", got ", t.sizes());
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == dt && t.device().is_cpu(), what,
                ": expected contiguous CPU tensors of the compute dtype ", dt, ", got ", t.scalar_type());
  }
}

// in the compute dtype (sources of another dtype under autocast: copied, as the PyTorch path
// does) and contiguous (no copy when they are already)
void prepare(std::vector<Tensor>& ts, at::ScalarType dt) {
  for (auto& t : ts) t = t.to(dt).contiguous();
}

// (a, *lead) for the statistics of sources of shape (*lead, D)
std::vector<int64_t> stat_shape(int64_t a, at::IntArrayRef shape) {
  std::vector<int64_t> s{a};
  s.insert(s.end(), shape.begin(), shape.end() - 1);
  return s;
}

// float or double (a plain function, not AT_DISPATCH: the loops' `#pragma omp simd` cannot sit in
// a macro's argument)
template <typename F>
void dispatch(at::ScalarType dt, F&& body) {
  if (dt == at::kFloat) {
    body(float{});
  } else if (dt == at::kDouble) {
    body(double{});
  } else {
    TORCH_CHECK(false, "the fused CPU kernel takes float32 or float64, got ", dt);
  }
}

// float or double, and for float a row width fixed at compile time where it is one of the narrow
// widths of the CPU studies' models: body(T{}, integral_constant<int64_t, D, or 0 for any>). With
// the width a constant the loops over a row unroll whole, with no loop or tail overhead, which at
// D 32 was most of what a row cost in the forward (1.3x to 1.4x faster at D 32 to 96, 2026-12-06;
// the backward, tried the same way, did not change). Each width is one more instantiation of the
// forward to compile.
template <typename F>
void dispatch_width(at::ScalarType dt, int64_t d, F&& body) {
  dispatch(dt, [&](auto tag) {
    if constexpr (std::is_same_v<decltype(tag), float>) {
      switch (d) {
        case 32: body(tag, std::integral_constant<int64_t, 32>{}); return;
        case 64: body(tag, std::integral_constant<int64_t, 64>{}); return;
        case 96: body(tag, std::integral_constant<int64_t, 96>{}); return;
        case 128: body(tag, std::integral_constant<int64_t, 128>{}); return;
        default: break;
      }
    }
    body(tag, std::integral_constant<int64_t, 0>{});
  });
}

// Queries are served in groups of up to kGroup: the inner loops over D then update one to
// kGroup accumulators or outputs per element read, the group's size a template parameter
// (`with_group`) so that each loop vectorises with its accumulators in registers.
constexpr int kGroup = 4;

template <typename F>
inline void with_group(int64_t g, F&& f) {
  switch (g) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// o[k][j] (= or +=) a[k] * v[j] for the G outputs o[0..G-1], in one pass over v
template <int G, bool Init, typename T>
inline void axpys(const T* v, const T* a, T* const* o, int64_t d) {
  T* o0 = o[0];
  T* o1 = G > 1 ? o[1] : o0;
  T* o2 = G > 2 ? o[2] : o0;
  T* o3 = G > 3 ? o[3] : o0;
  const T a0 = a[0], a1 = G > 1 ? a[1] : T(0), a2 = G > 2 ? a[2] : T(0), a3 = G > 3 ? a[3] : T(0);
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) {
    const T x = v[j];
    if constexpr (Init) {
      o0[j] = a0 * x;
      if constexpr (G > 1) o1[j] = a1 * x;
      if constexpr (G > 2) o2[j] = a2 * x;
      if constexpr (G > 3) o3[j] = a3 * x;
    } else {
      o0[j] += a0 * x;
      if constexpr (G > 1) o1[j] += a1 * x;
      if constexpr (G > 2) o2[j] += a2 * x;
      if constexpr (G > 3) o3[j] += a3 * x;
    }
  }
}

// exp in float32 from arithmetic alone, so that loops over it vectorise (std::exp does not):
// Cephes' expf (a degree-7 polynomial on [-ln2/2, ln2/2] times 2^k; within 2 ulp of the
// exact value), 0 below -87.3 (where float32 underflows), inf above 88, NaN kept. float64
// takes std::exp.
inline float exp_simd(float x) {
  const float xc = std::min(std::max(x, -87.3f), 88.0f);
  const float kf = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (xc - kf * 0.693359375f) - kf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float e = p * std::bit_cast<float>((static_cast<int32_t>(kf) + 127) << 23);
  return x != x ? x : (x < -87.3f ? 0.0f : (x > 88.0f ? std::numeric_limits<float>::infinity() : e));
}
inline double exp_simd(double x) { return std::exp(x); }

// Softmax over the sources for a tile of `tn` (<= kTile) consecutive tokens, vectorised across
// the tile: logits zs[i * kTile + u] of entry i (the prefix first when there is one) and token
// u; weights into alpha (same layout). The forward's form gives the log-sum-exp too; the
// backward's recomputes the weights from it as exp(z - lse) renormalised to sum to 1, as
// torch_fused._weights does (to float32 rounding the forward's weights).
constexpr int64_t kTile = 16;
static_assert(kTile % (kVecBytes / sizeof(float)) == 0, "a tile holds whole groups of W tokens");

// exp_simd on W lanes at once, branch-free (the selections as vector blends): `#pragma omp simd`
// over the scalar form left it a scalar loop with three branches per value (GCC 12), a third of
// the forward's time at D 32 (perf annotate, 2026-12-06)
inline vec<float> exp_lanes(const vec<float> x) {
  using V = vec<float>;
  typedef int32_t VI __attribute__((vector_size(sizeof(V))));
  const V lo = V{} - 87.3f, hi = V{} + 88.0f, zero = V{};
  const V xc = x < lo ? lo : (x > hi ? hi : x);
  const V kf = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const V r = (xc - kf * 0.693359375f) - kf * -2.12194440e-4f;
  V p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const VI bits = (__builtin_convertvector(kf, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(V));
  const V e = p * scale;
  const V inf = zero + std::numeric_limits<float>::infinity();
  return x != x ? x : (x < lo ? zero : (x > hi ? inf : e));
}

// alpha = exp(zs - shift[u]) per token u, normalised to sum to 1 over the cnt entries; `sum`
// gets the sums of the exponentials. float: W tokens a vector, the last vector's lanes past
// tn computed from whatever finite values the tile holds there and never read.
template <typename T>
inline void normalised_exp(const T* zs, const T* shift, int64_t cnt, int64_t tn, T* alpha, T* sum) {
  if constexpr (std::is_same_v<T, float>) {
    using V = vec<float>;
    constexpr int64_t W = sizeof(V) / sizeof(float);
    for (int64_t u0 = 0; u0 < tn; u0 += W) {
      const V sh = load<V>(shift + u0);
      V s{};
      for (int64_t i = 0; i < cnt; ++i) {
        const V e = exp_lanes(load<V>(zs + i * kTile + u0) - sh);
        store(alpha + i * kTile + u0, e);
        s += e;
      }
      store(sum + u0, s);
      const V inv = 1.0f / s;
      for (int64_t i = 0; i < cnt; ++i) store(alpha + i * kTile + u0, load<V>(alpha + i * kTile + u0) * inv);
    }
    return;
  }
  for (int64_t u = 0; u < tn; ++u) sum[u] = 0;
  for (int64_t i = 0; i < cnt; ++i) {
#pragma omp simd
    for (int64_t u = 0; u < tn; ++u) {
      const T e = exp_simd(zs[i * kTile + u] - shift[u]);
      alpha[i * kTile + u] = e;
      sum[u] += e;
    }
  }
  T inv[kTile];
  for (int64_t u = 0; u < tn; ++u) inv[u] = T(1) / sum[u];
  for (int64_t i = 0; i < cnt; ++i)
#pragma omp simd
    for (int64_t u = 0; u < tn; ++u) alpha[i * kTile + u] *= inv[u];
}

template <typename T>
inline void softmax_tile(const T* zs, int64_t cnt, int64_t tn, T* alpha, T* lse) {
  T mx[kTile], sum[kTile];
  for (int64_t u = 0; u < kTile; ++u) mx[u] = -std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < cnt; ++i)
    for (int64_t u = 0; u < tn; ++u) mx[u] = std::max(mx[u], zs[i * kTile + u]);
  for (int64_t u = 0; u < kTile; ++u) mx[u] = std::isfinite(mx[u]) ? mx[u] : T(0);  // 0 past tn too
  normalised_exp(zs, mx, cnt, tn, alpha, sum);
  for (int64_t u = 0; u < tn; ++u) lse[u] = mx[u] + std::log(sum[u]);
}

template <typename T>
inline void weights_tile(const T* zs, const T* lse, int64_t cnt, int64_t tn, T* alpha) {
  T sum[kTile];
  normalised_exp(zs, lse, cnt, tn, alpha, sum);
}

// -------------------------------------------------------------------------------------------------
// rows in groups: what a row costs whatever its width, paid once per group of rows
// -------------------------------------------------------------------------------------------------
// At D 32 a source row has 4 vector chunks, and the work that ends each of its dot products
// (a horizontal sum, a scalar stored into the tile) and starts each weighted sum (the output
// row loaded and stored again per source) cost more than the chunks themselves: 12.3 ns a row
// beside 0.227 ns a value (experiments/BENCHMARKS.md, "Where the op's time goes at D 32"). So
// the logits are formed for W consecutive tokens of a source (W: the lanes of a vector) as W
// vectors of partial sums, which one transpose-and-add turns into the W tokens' logits in one
// vector, stored where the tile's softmax reads them; and a weighted sum keeps its output in
// registers over all sources, a block of columns at a time, storing it once.

#define ATTNRES_INLINE inline __attribute__((always_inline))

#ifdef ATTNRES_HALVES
// lane L of the pairwise step of width B over (a, c): the first operand of a sum takes the lower
// B lanes of each 2B-lane group of a (lanes of a) or c (lanes of c, numbered from W), the second
// the upper B
template <std::size_t W, std::size_t B, bool Upper, std::size_t L>
constexpr int pair_lane() {
  constexpr std::size_t group = L / (2 * B), pos = L % (2 * B);
  return int((pos < B ? 0 : W) + group * 2 * B + pos % B + (Upper ? B : 0));
}
template <std::size_t B, typename V, std::size_t... L>
inline V pair_sums(const V& a, const V& c, std::index_sequence<L...>) {
  constexpr std::size_t W = sizeof...(L);
  return __builtin_shufflevector(a, c, pair_lane<W, B, false, L>()...) +
         __builtin_shufflevector(a, c, pair_lane<W, B, true, L>()...);
}
template <std::size_t B, typename V>
inline void lane_sums_from(V* x) {
  constexpr std::size_t W = sizeof(V) / sizeof(x[0][0]);
  if constexpr (B < W) {
    for (std::size_t p = 0; p < W; p += 2 * B) x[p] = pair_sums<B>(x[p], x[p + B], std::make_index_sequence<W>{});
    lane_sums_from<2 * B>(x);
  }
}
#endif

// lane u of the result = the sum of the lanes of x[u], for the W vectors x[0..W-1] (overwritten):
// log2 W steps of pairwise sums over pairs of vectors, W - 1 of them in all, where a horizontal
// sum per vector takes log2 W steps each
template <typename V>
inline V lane_sums(V* x) {
#ifdef ATTNRES_HALVES
  lane_sums_from<1>(x);
  return x[0];
#else
  V out;
  for (std::size_t u = 0; u < sizeof(V) / sizeof(x[0][0]); ++u) out[u] = hsum(x[u]);
  return out;
#endif
}

// part[k][u] = the vector partial sums of v . b[k] (and with Self part[G][u] of v . v) over row
// v: the chunks' products summed lane by lane, the tail of a D that the lanes do not divide
// added into lane 0
template <int G, bool Self, typename T>
ATTNRES_INLINE void partial_dots(const T* v, const T* const* b, int64_t d, vec<T> (*part)[sizeof(vec<T>) / sizeof(T)],
                         int64_t u) {
  using V = vec<T>;
  constexpr int64_t W = sizeof(V) / sizeof(T);
  V s[G + 1] = {};
  int64_t j = 0;
  for (; j + W <= d; j += W) {
    const V x = load<V>(v + j);
    for (int k = 0; k < G; ++k) s[k] += x * load<V>(b[k] + j);
    if constexpr (Self) s[G] += x * x;
  }
  for (; j < d; ++j) {
    const T x = v[j];
    for (int k = 0; k < G; ++k) s[k][0] += x * b[k][j];
    if constexpr (Self) s[G][0] += x * x;
  }
  for (int k = 0; k < G + (Self ? 1 : 0); ++k) part[k][u] = s[k];
}

// the logits of G queries (b) over the W tokens [t, t + tn) of one source (rows of d values
// from v), tn <= W: out[k][0..W) (lanes from tn on 0), and with Self out[G] the rows' v . v
template <int G, bool Self, typename T>
ATTNRES_INLINE void group_dots(const T* v, const T* const* b, int64_t d, int64_t tn, T* const* out) {
  using V = vec<T>;
  constexpr int64_t W = sizeof(V) / sizeof(T);
  V part[G + 1][W];
  for (int64_t u = 0; u < W; ++u) {
    if (u < tn) {
      partial_dots<G, Self>(v + u * d, b, d, part, u);
    } else {
      for (int k = 0; k < G + (Self ? 1 : 0); ++k) part[k][u] = V{};
    }
  }
  for (int k = 0; k < G + (Self ? 1 : 0); ++k) store(out[k], lane_sums(part[k]));
}

// o[k][j0 .. j0 + C W) (= when Fresh, else +=) sum_i a[k * stride_k + i * kTile] v_i[j0 ..] over the
// n rows v_i = rows[i] + offset, the C chunks of each of the G outputs held in registers
template <int G, int C, bool Fresh, typename T>
ATTNRES_INLINE void weighted_block(const void* const* rows, int64_t offset, int64_t n, const T* a, int64_t stride_k,
                           T* const* o, int64_t j0) {
  using V = vec<T>;
  constexpr int64_t W = sizeof(V) / sizeof(T);
  V acc[G][C];
  for (int k = 0; k < G; ++k)
    for (int c = 0; c < C; ++c) acc[k][c] = Fresh ? V{} : load<V>(o[k] + j0 + c * W);
  for (int64_t i = 0; i < n; ++i) {
    const T* v = static_cast<const T*>(rows[i]) + offset + j0;
    for (int k = 0; k < G; ++k) {
      const T ak = a[k * stride_k + i * kTile];
      for (int c = 0; c < C; ++c) acc[k][c] += ak * load<V>(v + c * W);
    }
  }
  for (int k = 0; k < G; ++k)
    for (int c = 0; c < C; ++c) store(o[k] + j0 + c * W, acc[k][c]);
}

// body(integral_constant<int, c>) for the c = 1 .. 7 (below C) chunks left after the whole blocks
template <int C, typename F>
ATTNRES_INLINE void with_chunks_left(int64_t left, F&& body) {
  switch (left) {
    case 1: body(std::integral_constant<int, 1>{}); break;
    case 2: body(std::integral_constant<int, (C > 2 ? 2 : 1)>{}); break;
    case 3: body(std::integral_constant<int, (C > 3 ? 3 : 1)>{}); break;
    case 4: body(std::integral_constant<int, (C > 4 ? 4 : 1)>{}); break;
    case 5: body(std::integral_constant<int, (C > 5 ? 5 : 1)>{}); break;
    case 6: body(std::integral_constant<int, (C > 6 ? 6 : 1)>{}); break;
    case 7: body(std::integral_constant<int, (C > 7 ? 7 : 1)>{}); break;
    default: break;
  }
}

// the weighted sums of G outputs over a row of d values: blocks of up to 8 / G chunks (the
// accumulators in at most 8 vector registers), the last block the chunks left, then the
// values past the last whole chunk one at a time
template <int G, bool Fresh, typename T>
ATTNRES_INLINE void weighted_rows(const void* const* rows, int64_t offset, int64_t n, const T* a, int64_t stride_k,
                          T* const* o, int64_t d) {
  constexpr int64_t W = sizeof(vec<T>) / sizeof(T);
  constexpr int C = G == 1 ? 8 : G == 2 ? 4 : 2;
  int64_t j = 0;
  for (; j + C * W <= d; j += C * W) weighted_block<G, C, Fresh>(rows, offset, n, a, stride_k, o, j);
  with_chunks_left<C>((d - j) / W, [&](auto c) {
    weighted_block<G, decltype(c)::value, Fresh>(rows, offset, n, a, stride_k, o, j);
    j += decltype(c)::value * W;
  });
  for (; j < d; ++j) {
    T s[G];
    for (int k = 0; k < G; ++k) s[k] = Fresh ? T(0) : o[k][j];
    for (int64_t i = 0; i < n; ++i) {
      const T x = static_cast<const T*>(rows[i])[offset + j];
      for (int k = 0; k < G; ++k) s[k] += a[k * stride_k + i * kTile] * x;
    }
    for (int k = 0; k < G; ++k) o[k][j] = s[k];
  }
}

// the dot products of the W tokens [t, t + tn) of one source (rows of d values from v) with G
// rows per token, rows[k * kTile + u] for token u, tn <= W: out[k][0..W) (lanes from tn on 0)
template <int G, typename T>
ATTNRES_INLINE void group_row_dots(const T* v, const T* const* rows, int64_t d, int64_t tn, T* const* out) {
  using V = vec<T>;
  constexpr int64_t W = sizeof(V) / sizeof(T);
  V part[G + 1][W];
  for (int64_t u = 0; u < W; ++u) {
    if (u < tn) {
      const T* b[G];
      for (int k = 0; k < G; ++k) b[k] = rows[k * kTile + u];
      partial_dots<G, false>(v + u * d, b, d, part, u);
    } else {
      for (int k = 0; k < G; ++k) part[k][u] = V{};
    }
  }
  for (int k = 0; k < G; ++k) store(out[k], lane_sums(part[k]));
}

// One source's gradient over the tn tokens of a tile, for a group of G queries, columns
// [j0, j0 + C W): dv[u] (= when Fresh, else +=) sum_k (a_k[u] dO_k[u] + cr_k[u] q_k) and with
// Self cs[u] (r[u] v[u]); the query-gradient terms sum_u cr_k[u] v[u] summed over the tile in
// registers and added to tq_k once (per row they were a read-modify-write of tq each).
// dO_k[u] = dor[k * kTile + u], a_k[u] = a[k * a_stride + u], cr_k[u] = cr[k * kTile + u].
template <int G, int C, bool Self, bool Fresh, typename T>
ATTNRES_INLINE void source_grad_block(const T* v, T* dv, int64_t d, int64_t tn, const T* const* dor, const T* q,
                                      const T* a, int64_t a_stride, const T* cr, const T* cs, const T* r, T* tq,
                                      int64_t j0) {
  using V = vec<T>;
  constexpr int64_t W = sizeof(V) / sizeof(T);
  V tacc[G][C] = {};
  for (int64_t u = 0; u < tn; ++u) {
    const T* vu = v + u * d + j0;
    T* ou = dv + u * d + j0;
    for (int c = 0; c < C; ++c) {
      const V x = load<V>(vu + c * W);
      V acc = Fresh ? V{} : load<V>(ou + c * W);
      if constexpr (Self) acc += cs[u] * (x * r[u]);
      for (int k = 0; k < G; ++k) {
        acc += a[k * a_stride + u] * load<V>(dor[k * kTile + u] + j0 + c * W) +
               cr[k * kTile + u] * load<V>(q + k * d + j0 + c * W);
        tacc[k][c] += cr[k * kTile + u] * x;
      }
      store(ou + c * W, acc);
    }
  }
  for (int k = 0; k < G; ++k)
    for (int c = 0; c < C; ++c) store(tq + k * d + j0 + c * W, load<V>(tq + k * d + j0 + c * W) + tacc[k][c]);
}

// source_grad_block over a whole row: blocks of 8 / G chunks (the query-gradient sums in at most
// 8 vector registers), the chunks left as one block, then the values past the last whole chunk
// one at a time
template <int G, bool Self, bool Fresh, typename T>
ATTNRES_INLINE void source_grad(const T* v, T* dv, int64_t d, int64_t tn, const T* const* dor, const T* q,
                                const T* a, int64_t a_stride, const T* cr, const T* cs, const T* r, T* tq) {
  constexpr int64_t W = sizeof(vec<T>) / sizeof(T);
  constexpr int C = G == 1 ? 8 : G == 2 ? 4 : 2;
  int64_t j = 0;
  for (; j + C * W <= d; j += C * W)
    source_grad_block<G, C, Self, Fresh>(v, dv, d, tn, dor, q, a, a_stride, cr, cs, r, tq, j);
  with_chunks_left<C>((d - j) / W, [&](auto c) {
    source_grad_block<G, decltype(c)::value, Self, Fresh>(v, dv, d, tn, dor, q, a, a_stride, cr, cs, r, tq, j);
    j += decltype(c)::value * W;
  });
  for (; j < d; ++j) {
    T tsum[G] = {};
    for (int64_t u = 0; u < tn; ++u) {
      const T x = v[u * d + j];
      T acc = Fresh ? T(0) : dv[u * d + j];
      if constexpr (Self) acc += cs[u] * (x * r[u]);
      for (int k = 0; k < G; ++k) {
        acc += a[k * a_stride + u] * dor[k * kTile + u][j] + cr[k * kTile + u] * q[k * d + j];
        tsum[k] += cr[k * kTile + u] * x;
      }
      dv[u * d + j] = acc;
    }
    for (int k = 0; k < G; ++k) tq[k * d + j] += tsum[k];
  }
}

// -------------------------------------------------------------------------------------------------
// forward
// -------------------------------------------------------------------------------------------------

std::tuple<std::vector<Tensor>, Tensor, Tensor, Tensor, Tensor, Tensor> forward(
    std::vector<Tensor> vals, const c10::optional<Tensor>& r_cache, const Tensor& queries_in,
    std::vector<Tensor> prefix_h, const c10::optional<Tensor>& prefix_lse_in, double eps,
    const c10::optional<Tensor>& out_norm_in, double out_eps) {
  TORCH_CHECK(!vals.empty(), "depth attention needs at least one source");
  const auto dt0 = queries_in.scalar_type();
  prepare(vals, dt0);
  prepare(prefix_h, dt0);
  const Tensor queries = queries_in.contiguous();
  const auto dt = queries.scalar_type();
  const at::IntArrayRef shape = vals[0].sizes();
  const int64_t n = vals.size(), K = queries.size(0), d = queries.size(1), m = vals[0].numel() / std::max<int64_t>(d, 1);
  TORCH_CHECK(shape.size() >= 1 && shape.back() == d, "sources must be (..., D) with the queries' D");
  check_rows(vals, shape, dt, "sources");
  const bool has_prefix = prefix_lse_in.has_value() && prefix_lse_in->defined();
  const bool has_norm = out_norm_in.has_value() && out_norm_in->defined();
  if (has_prefix) {
    TORCH_CHECK((int64_t)prefix_h.size() == K, "one prefix per query");
    check_rows(prefix_h, shape, dt, "prefix_h");
  }
  const Tensor prefix_lse = has_prefix ? prefix_lse_in->to(dt).contiguous() : Tensor();
  const Tensor out_norm = has_norm ? out_norm_in->to(dt).contiguous() : Tensor();
  const bool cached = r_cache.has_value() && r_cache->defined();
  Tensor r = cached ? r_cache->to(dt).contiguous() : queries.new_empty(stat_shape(n, shape));
  TORCH_CHECK(r.numel() == n * m, "r_cache: expected ", n * m, " statistics");
  std::vector<int64_t> z_shape = stat_shape(n, shape);
  z_shape.insert(z_shape.begin(), K);
  Tensor z = queries.new_empty(z_shape);
  Tensor lse = queries.new_empty(stat_shape(K, shape));
  std::vector<Tensor> outs;
  for (int64_t k = 0; k < K; ++k) outs.push_back(queries.new_empty(shape));
  Tensor h = has_norm ? queries.new_empty(shape) : queries.new_empty({0});
  Tensor hn = has_norm ? queries.new_empty(shape.slice(0, shape.size() - 1)) : queries.new_empty({0});
  const auto src = pointers(vals), pre = pointers(prefix_h);
  const auto outp = pointers(outs);

  const int64_t d_any = d;
  auto body = [&](auto tag, auto width) {
    using T = decltype(tag);
    const int64_t d = decltype(width)::value ? decltype(width)::value : d_any;  // a constant where it can be
    constexpr int64_t W = sizeof(vec<T>) / sizeof(T);  // tokens per group of logits
    const T* q = queries.data_ptr<T>();
    T* rp = r.data_ptr<T>();
    T* zp = z.data_ptr<T>();
    T* lp = lse.data_ptr<T>();
    const T* plse = has_prefix ? prefix_lse.data_ptr<T>() : nullptr;
    const T* w = has_norm ? out_norm.data_ptr<T>() : nullptr;
    T* hp = has_norm ? h.data_ptr<T>() : nullptr;
    T* hnp = has_norm ? hn.data_ptr<T>() : nullptr;
    std::vector<const T*> qrows(K);
    for (int64_t k = 0; k < K; ++k) qrows[k] = q + k * d;
    at::parallel_for(0, m, kGrain, [&](int64_t begin, int64_t end) {
      const int64_t off = has_prefix ? 1 : 0, cnt = n + off;
      // per tile: the logits zs[(k * cnt + i) * kTile + u], the weights in the same layout
      std::vector<T> zs(K * cnt * kTile), alpha(K * cnt * kTile), lt(kTile), ss(n * kTile);
      std::vector<T*> orow(K);
      for (int64_t t0 = begin; t0 < end; t0 += kTile) {
        const int64_t tn = std::min(kTile, end - t0);
        // the logits: each source row read once for all K queries, v . v beside v . q_k when
        // the statistic is not given; then the statistics and the scaling vectorised across the tile
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t u0 = 0; u0 < tn; u0 += W) {  // W tokens' logits at a time (`group_dots`)
            const T* v = static_cast<const T*>(src[i]) + (t0 + u0) * d;
            const int64_t un = std::min(W, tn - u0);
            for (int64_t k0 = 0; k0 < K; k0 += kGroup) {
              with_group(std::min<int64_t>(kGroup, K - k0), [&](auto g) {
                constexpr int G = decltype(g)::value;
                T* into[kGroup + 1];
                for (int k = 0; k < G; ++k) into[k] = zs.data() + ((k0 + k) * cnt + off + i) * kTile + u0;
                if (k0 == 0 && !cached) {
                  into[G] = ss.data() + i * kTile + u0;
                  group_dots<G, true>(v, qrows.data(), d, un, into);
                } else {
                  group_dots<G, false>(v, qrows.data() + k0, d, un, into);
                }
              });
            }
          }
        }
        if (!cached) {
          for (int64_t i = 0; i < n; ++i) {
            T* ri = rp + i * m + t0;
            const T* si = ss.data() + i * kTile;
#pragma omp simd
            for (int64_t u = 0; u < tn; ++u) ri[u] = T(1) / std::sqrt(si[u] / T(d) + T(eps));
            for (int64_t u = 0; u < tn; ++u)  // a square that overflowed: the row rescaled
              if (!std::isfinite(si[u]))
                ri[u] = row_inv_rms(static_cast<const T*>(src[i]) + (t0 + u) * d, d, eps, si[u]);
          }
        }
        for (int64_t k = 0; k < K; ++k)
          for (int64_t i = 0; i < n; ++i) {
            T* zi = zs.data() + (k * cnt + off + i) * kTile;
            const T* ri = rp + i * m + t0;
#pragma omp simd
            for (int64_t u = 0; u < tn; ++u) zi[u] *= ri[u];
          }
        for (int64_t k = 0; k < K; ++k) {
          T* zk_ = zs.data() + k * cnt * kTile;
          if (has_prefix)
            for (int64_t u = 0; u < tn; ++u) zk_[u] = plse[k * m + t0 + u];
          for (int64_t i = 0; i < n; ++i)
            for (int64_t u = 0; u < tn; ++u) zp[(k * n + i) * m + t0 + u] = zk_[(off + i) * kTile + u];
          softmax_tile(zk_, cnt, tn, alpha.data() + k * cnt * kTile, lt.data());
          for (int64_t u = 0; u < tn; ++u) lp[k * m + t0 + u] = lt[u];
        }
        for (int64_t u = 0; u < tn; ++u) {
        const int64_t t = t0 + u;
        // with a fused norm, output 0's h goes to its own tensor and output 0 gets y = RMSNorm(h) w
        for (int64_t k = 0; k < K; ++k)
          orow[k] = has_norm && k == 0 ? hp + t * d : static_cast<T*>(const_cast<void*>(outp[k])) + t * d;
        // the weighted sums, the prefix's term first where there is one: each source row read
        // once per group of queries, the outputs kept in registers over the sources
        if (has_prefix) {
          for (int64_t k = 0; k < K; ++k) {
            const T a = alpha[k * cnt * kTile + u];
            axpys<1, true>(static_cast<const T*>(pre[k]) + t * d, &a, orow.data() + k, d);
          }
        }
        for (int64_t k0 = 0; k0 < K; k0 += kGroup) {
          with_group(std::min<int64_t>(kGroup, K - k0), [&](auto g) {
            constexpr int G = decltype(g)::value;
            const T* a = alpha.data() + (k0 * cnt + off) * kTile + u;
            if (has_prefix) {
              weighted_rows<G, false>(src.data(), t * d, n, a, cnt * kTile, orow.data() + k0, d);
            } else {
              weighted_rows<G, true>(src.data(), t * d, n, a, cnt * kTile, orow.data() + k0, d);
            }
          });
        }
        if (has_norm) {  // y = h * n * w from the unrounded h
          const T* o = orow[0];
          const T nh = T(1) / std::sqrt(dot(o, o, d) / T(d) + T(out_eps));
          hnp[t] = nh;
          T* y = static_cast<T*>(const_cast<void*>(outp[0])) + t * d;
#pragma omp simd
          for (int64_t j = 0; j < d; ++j) y[j] = o[j] * nh * w[j];
        }
        }
      }
    });
  };
  dispatch_width(dt, d, body);
  return {outs, z, lse, r, h, hn};
}

// -------------------------------------------------------------------------------------------------
// backward
// -------------------------------------------------------------------------------------------------

std::tuple<std::vector<Tensor>, Tensor, std::vector<Tensor>, Tensor, Tensor> backward(
    std::vector<Tensor> vals, const Tensor& r_in, const Tensor& queries_in, const Tensor& z_in, const Tensor& lse_in,
    const c10::optional<Tensor>& prefix_lse_in, std::vector<Tensor> outs, std::vector<c10::optional<Tensor>> d_outs,
    const c10::optional<Tensor>& dz_ext_in, const c10::optional<Tensor>& dlse_in,
    const c10::optional<Tensor>& out_norm_in, const c10::optional<Tensor>& h_in,
    const c10::optional<Tensor>& h_inv_rms_in, std::vector<c10::optional<Tensor>> accumulate) {
  prepare(vals, queries_in.scalar_type());
  prepare(outs, queries_in.scalar_type());
  const Tensor queries = queries_in.contiguous();
  const auto dt = queries.scalar_type();
  const at::IntArrayRef shape = vals[0].sizes();
  const int64_t n = vals.size(), K = queries.size(0), d = queries.size(1), m = vals[0].numel() / std::max<int64_t>(d, 1);
  check_rows(vals, shape, dt, "sources");
  const Tensor r = r_in.contiguous(), z = z_in.contiguous(), lse = lse_in.contiguous();
  TORCH_CHECK(r.numel() == n * m && z.numel() == K * n * m && lse.numel() == K * m, "statistics of the wrong size");
  const bool has_prefix = prefix_lse_in.has_value() && prefix_lse_in->defined();
  const bool has_norm = out_norm_in.has_value() && out_norm_in->defined();
  const bool has_dz = dz_ext_in.has_value() && dz_ext_in->defined();
  const bool has_dlse = dlse_in.has_value() && dlse_in->defined();
  TORCH_CHECK((int64_t)d_outs.size() == K, "one output cotangent (or None) per query");
  if (has_prefix) check_rows(outs, shape, dt, "outs");
  std::vector<Tensor> dO;
  std::vector<char> present(K);
  for (int64_t k = 0; k < K; ++k) {
    present[k] = d_outs[k].has_value() && d_outs[k]->defined();
    dO.push_back(present[k] ? d_outs[k]->to(dt).contiguous() : Tensor());
  }
  for (int64_t k = 0; k < K; ++k)
    if (present[k]) check_rows({dO[k]}, shape, dt, "output cotangents");
  const Tensor prefix_lse = has_prefix ? prefix_lse_in->to(dt).contiguous() : Tensor();
  const Tensor dz_ext = has_dz ? dz_ext_in->to(dt).contiguous() : Tensor();
  const Tensor dlse = has_dlse ? dlse_in->to(dt).contiguous() : Tensor();
  const Tensor out_norm = has_norm ? out_norm_in->to(dt).contiguous() : Tensor();
  const Tensor h = has_norm ? h_in->to(dt).contiguous() : Tensor();
  const Tensor hn = has_norm ? h_inv_rms_in->to(dt).contiguous() : Tensor();

  // a source's gradient goes into a fresh tensor, or is added to the one `accumulate` names
  // (a gradient sink: one buffer per source over all the calls that read it, where autograd
  // would otherwise add each call's gradient to the others in a pass of its own)
  TORCH_CHECK(accumulate.empty() || (int64_t)accumulate.size() == n, "accumulate: one entry (or None) per source");
  std::vector<Tensor> dV, d_pre_h;
  std::vector<char> adds(n, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (!accumulate.empty() && accumulate[i].has_value() && accumulate[i]->defined()) {
      check_rows({*accumulate[i]}, shape, dt, "accumulate");
      dV.push_back(*accumulate[i]);
      adds[i] = 1;
    } else {
      dV.push_back(queries.new_empty(shape));
    }
  }
  if (has_prefix)
    for (int64_t k = 0; k < K; ++k) d_pre_h.push_back(queries.new_empty(shape));
  Tensor d_pre_lse = has_prefix ? queries.new_empty(stat_shape(K, shape)) : queries.new_empty({0});
  const int64_t nthreads = at::get_num_threads();
  // per thread: K * D query-gradient sums, then D norm-weight sums, in float64
  std::vector<double> acc(nthreads * (K + 1) * d, 0.0);
  const auto src = pointers(vals), ops = pointers(outs), dop = pointers(dO), dvp = pointers(dV),
             dph = pointers(d_pre_h);

  const int64_t d_any = d;
  auto body = [&](auto tag, auto width) {
    using T = decltype(tag);
    const int64_t d = decltype(width)::value ? decltype(width)::value : d_any;  // a constant where it can be
    constexpr int64_t W = sizeof(vec<T>) / sizeof(T);  // tokens per group of dot products
    const T* q = queries.data_ptr<T>();
    const T* rp = r.data_ptr<T>();
    const T* zp = z.data_ptr<T>();
    const T* lp = lse.data_ptr<T>();
    const T* plse = has_prefix ? prefix_lse.data_ptr<T>() : nullptr;
    const T* dzp = has_dz ? dz_ext.data_ptr<T>() : nullptr;
    const T* dlp = has_dlse ? dlse.data_ptr<T>() : nullptr;
    const T* w = has_norm ? out_norm.data_ptr<T>() : nullptr;
    const T* hp = has_norm ? h.data_ptr<T>() : nullptr;
    const T* hnp = has_norm ? hn.data_ptr<T>() : nullptr;
    T* dpl = has_prefix ? d_pre_lse.data_ptr<T>() : nullptr;
    at::parallel_for(0, m, kGrain, [&](int64_t begin, int64_t end) {
      const int64_t off = has_prefix ? 1 : 0, cnt = n + off;
      // per tile: the weights as the forward's zs / alpha, g and dz as [(k * n + i) * kTile + u]
      std::vector<T> zs(K * cnt * kTile), alpha(K * cnt * kTile), lt(kTile), g(K * n * kTile), dz(K * n * kTile),
          cr(K * kTile), dobuf(kTile * d), zero(d, T(0));
      std::vector<T> tq((K + 1) * d, T(0));  // this thread's query / norm-weight sums since the last flush
      std::vector<const T*> dorows(K * kTile);
      double* mine = acc.data() + at::get_thread_num() * (K + 1) * d;
      auto flush = [&] {  // into this thread's float64 sums every kGrain tokens
        for (int64_t j = 0; j < (K + 1) * d; ++j) mine[j] += tq[j];
        std::fill(tq.begin(), tq.end(), T(0));
      };
      for (int64_t t0 = begin; t0 < end; t0 += kTile) {
        const int64_t tn = std::min(kTile, end - t0);
        if (t0 > begin && (t0 - begin) % kGrain == 0) flush();
        for (int64_t k = 0; k < K; ++k) {  // the weights, as the forward computed them
          T* zk_ = zs.data() + k * cnt * kTile;
          if (has_prefix)
            for (int64_t u = 0; u < tn; ++u) zk_[u] = plse[k * m + t0 + u];
          for (int64_t i = 0; i < n; ++i)
            for (int64_t u = 0; u < tn; ++u) zk_[(off + i) * kTile + u] = zp[(k * n + i) * m + t0 + u];
          for (int64_t u = 0; u < tn; ++u) lt[u] = lp[k * m + t0 + u];
          weights_tile(zk_, lt.data(), cnt, tn, alpha.data() + k * cnt * kTile);
        }
        // the cotangent rows of the tile's tokens, dorows[k * kTile + u]
        for (int64_t u = 0; u < tn; ++u) {
          const int64_t t = t0 + u;
          for (int64_t k = 0; k < K; ++k) {
            const T* dy = present[k] ? static_cast<const T*>(dop[k]) + t * d : zero.data();
            if (has_norm && k == 0) {  // from the cotangent of y = h * n * w to that of h (output 0)
              const T* hr = hp + t * d;
              const T nh = hnp[t];
              T* db = dobuf.data() + u * d;
              T* tw = tq.data() + K * d;
              T s = 0;
#pragma omp simd reduction(+ : s)
              for (int64_t j = 0; j < d; ++j) {
                const T wdy = dy[j] * w[j];
                tw[j] += nh * dy[j] * hr[j];
                db[j] = wdy;
                s += wdy * hr[j];
              }
              // n^3 / D (wdy . h) h as (n (wdy . h) n / D) (n h): n^3 alone under- or overflows
              const T c = nh * s * nh / T(d);
#pragma omp simd
              for (int64_t j = 0; j < d; ++j) db[j] = db[j] * nh - c * (hr[j] * nh);
              dorows[k * kTile + u] = db;
            } else {
              dorows[k * kTile + u] = dy;
            }
          }
        }
        // g[(k * n + i) * kTile + u] = dO_k . v_i of token u: W tokens of a source at a time
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t u0 = 0; u0 < tn; u0 += W) {
            const T* v = static_cast<const T*>(src[i]) + (t0 + u0) * d;
            const int64_t un = std::min(W, tn - u0);
            for (int64_t k0 = 0; k0 < K; k0 += kGroup) {
              with_group(std::min<int64_t>(kGroup, K - k0), [&](auto gr) {
                constexpr int G = decltype(gr)::value;
                T* into[kGroup];
                for (int k = 0; k < G; ++k) into[k] = g.data() + ((k0 + k) * n + i) * kTile + u0;
                group_row_dots<G>(v, dorows.data() + k0 * kTile + u0, d, un, into);
              });
            }
          }
        }
        // the logits' cotangents dz, across the tile's tokens
        for (int64_t k = 0; k < K; ++k) {
          const T* ak = alpha.data() + (k * cnt + off) * kTile;  // ak[i * kTile + u]: source i's weight
          const T* gk = g.data() + k * n * kTile;
          T* dzk = dz.data() + k * n * kTile;
          T ag[kTile] = {}, P[kTile], dl[kTile];
          for (int64_t i = 0; i < n; ++i)
            for (int64_t u = 0; u < tn; ++u) ag[u] += ak[i * kTile + u] * gk[i * kTile + u];
          for (int64_t u = 0; u < tn; ++u) {
            // with a prefix P_k = dO_k . h_k, where output 0's h is the tensor kept beside its y
            const int64_t t = t0 + u;
            P[u] = !has_prefix ? ag[u]
                   : dot(dorows[k * kTile + u], has_norm && k == 0 ? hp + t * d : static_cast<const T*>(ops[k]) + t * d, d);
            dl[u] = has_dlse ? dlp[k * m + t] : T(0);
          }
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t u = 0; u < tn; ++u) {
              const T a = ak[i * kTile + u];
              dzk[i * kTile + u] = a * (gk[i * kTile + u] - P[u]) + a * dl[u];
            }
            if (has_dz)
              for (int64_t u = 0; u < tn; ++u) dzk[i * kTile + u] += dzp[(k * n + i) * m + t0 + u];
          }
          if (has_prefix) {
            for (int64_t u = 0; u < tn; ++u) {
              const int64_t t = t0 + u;
              const T ap = alpha[k * cnt * kTile + u];
              dpl[k * m + t] = P[u] - ag[u] - ap * P[u] + ap * dl[u];
              T* o = static_cast<T*>(const_cast<void*>(dph[k])) + t * d;
              const T* dor = dorows[k * kTile + u];
#pragma omp simd
              for (int64_t j = 0; j < d; ++j) o[j] = ap * dor[j];
            }
          }
        }
        // dv_i = c_i (r_i v_i) + sum_k (alpha_ki dO_k + dz_ki r_i q_k): each source row read once
        // per group of queries, the query-gradient terms summed over the tile in registers
        for (int64_t i = 0; i < n; ++i) {
          T rt[kTile], cz[kTile] = {}, ct[kTile];
          for (int64_t u = 0; u < tn; ++u) rt[u] = rp[i * m + t0 + u];
          for (int64_t k = 0; k < K; ++k) {
            const T* dzk = dz.data() + (k * n + i) * kTile;
            const T* zk = zp + (k * n + i) * m + t0;
            T* crk = cr.data() + k * kTile;
            for (int64_t u = 0; u < tn; ++u) {
              cz[u] += dzk[u] * zk[u];
              crk[u] = dzk[u] * rt[u];
            }
          }
          // the derivative through r_i, c (r_i v_i) with c = -cz r_i / D: r_i^2 alone under- or
          // overflows for |v| beyond ~1e19 or below ~1e-19 in float32, (r_i v_i) and c do not
          for (int64_t u = 0; u < tn; ++u) ct[u] = -cz[u] * rt[u] / T(d);
          const T* v = static_cast<const T*>(src[i]) + t0 * d;
          T* o = static_cast<T*>(const_cast<void*>(dvp[i])) + t0 * d;
          for (int64_t k0 = 0; k0 < K; k0 += kGroup) {
            with_group(std::min<int64_t>(kGroup, K - k0), [&](auto gr) {
              constexpr int G = decltype(gr)::value;
              const T* a = alpha.data() + (k0 * cnt + off + i) * kTile;
              const T* const* dk = dorows.data() + k0 * kTile;
              const T* crk = cr.data() + k0 * kTile;
              T* tk = tq.data() + k0 * d;
              if (k0 > 0) {
                source_grad<G, false, false>(v, o, d, tn, dk, q + k0 * d, a, cnt * kTile, crk, ct, rt, tk);
              } else if (adds[i]) {
                source_grad<G, true, false>(v, o, d, tn, dk, q, a, cnt * kTile, crk, ct, rt, tk);
              } else {
                source_grad<G, true, true>(v, o, d, tn, dk, q, a, cnt * kTile, crk, ct, rt, tk);
              }
            });
          }
        }
      }
      flush();
    });
  };
  dispatch_width(dt, d, body);
  Tensor d_q = at::zeros({K, d}, queries.options().dtype(at::kDouble));
  Tensor d_w = at::zeros({has_norm ? d : 0}, queries.options().dtype(at::kDouble));
  double* dqp = d_q.data_ptr<double>();
  double* dwp = d_w.data_ptr<double>();
  for (int64_t th = 0; th < nthreads; ++th) {
    const double* a = acc.data() + th * (K + 1) * d;
    for (int64_t j = 0; j < K * d; ++j) dqp[j] += a[j];
    if (has_norm)
      for (int64_t j = 0; j < d; ++j) dwp[j] += a[K * d + j];
  }
  return {dV, d_q.to(dt), d_pre_h, d_pre_lse, d_w.to(dt)};
}

// -------------------------------------------------------------------------------------------------
// one query, no statistics kept: decoding
// -------------------------------------------------------------------------------------------------

// h (..., D) of row `row` of the gain-folded queries (K, D) over the sources, without gradient:
// the strategies' one-pass route (decoding, a token or a few per call), where a call's fixed
// cost is the mix's cost. So: one allocation (the result), the scratch on the stack, the tokens
// on the calling thread, the query picked here rather than as a Python view. Per token as
// `forward`: logits v_i . q r_i, the softmax over sources, the weighted sum, in T, rounded once.
Tensor mix(std::vector<Tensor> vals, const Tensor& queries, int64_t row, double eps) {
  TORCH_CHECK(!vals.empty(), "depth attention needs at least one source");
  const auto dt = queries.scalar_type();
  prepare(vals, dt);  // no copy for contiguous sources of the queries' dtype (a sublayer may return a view)
  const at::IntArrayRef shape = vals[0].sizes();
  const int64_t n = vals.size(), d = queries.size(-1), m = vals[0].numel() / std::max<int64_t>(d, 1);
  TORCH_CHECK(queries.dim() == 2 && queries.is_contiguous() && row >= 0 && row < queries.size(0),
              "queries: a contiguous (K, D) tensor and a row of it");
  TORCH_CHECK(shape.size() >= 1 && shape.back() == d, "sources must be (..., D) with the queries' D");
  check_rows(vals, shape, dt, "sources");
  Tensor out = at::empty(shape, queries.options());
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    const T* q = queries.data_ptr<T>() + row * d;
    T* o = out.data_ptr<T>();
    c10::SmallVector<const T*, 32> src(n);
    c10::SmallVector<T, 32> z(n);
    for (int64_t i = 0; i < n; ++i) src[i] = vals[i].data_ptr<T>();
    for (int64_t t = 0; t < m; ++t) {
      T top = -std::numeric_limits<T>::infinity(), sum = 0, qs[2];
      for (int64_t i = 0; i < n; ++i) {
        const T* v = src[i] + t * d;
        dots<1, true>(v, &q, d, qs);
        z[i] = qs[0] * row_inv_rms(v, d, eps, qs[1]);
        top = std::max(top, z[i]);
      }
      for (int64_t i = 0; i < n; ++i) sum += (z[i] = std::exp(z[i] - top));
      T* orow = o + t * d;
      for (int64_t i = 0; i < n; ++i) {
        const T a = z[i] / sum;
        if (i == 0) {
          axpys<1, true>(src[i] + t * d, &a, &orow, d);
        } else {
          axpys<1, false>(src[i] + t * d, &a, &orow, d);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(attnres_cpu, lib) {
  lib.def(
      "forward(Tensor[] vals, Tensor? r_cache, Tensor queries, Tensor[] prefix_h, Tensor? prefix_lse, float eps, "
      "Tensor? out_norm, float out_eps) -> (Tensor[], Tensor, Tensor, Tensor, Tensor, Tensor)");
  lib.def(
      "backward(Tensor[] vals, Tensor r, Tensor queries, Tensor z, Tensor lse, Tensor? prefix_lse, Tensor[] outs, "
      "Tensor?[] d_outs, Tensor? dz_ext, Tensor? dlse, Tensor? out_norm, Tensor? h, Tensor? h_inv_rms, "
      "Tensor?[] accumulate) -> "
      "(Tensor[], Tensor, Tensor[], Tensor, Tensor)");
  lib.def("mix(Tensor[] vals, Tensor queries, int row, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnres_cpu, CPU, lib) {
  lib.impl("forward", &forward);
  lib.impl("backward", &backward);
  lib.impl("mix", &mix);
}
