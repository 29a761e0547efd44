// Decoding-step kernels for XLA:CPU as XLA FFI custom calls (kernels/cpu_decoding.py builds and
// registers them): the two attentions, the products by the decoder's weights, and beam search's choice
// of candidates. One call does what XLA runs as a dozen small ops (scores, mask, max, exp, sum, divide,
// weighted sum, and the transposes between them; log_softmax, masks and top-k), each of which costs a
// dispatch.
//
//   aiayn_slot_attention(q [b, j, h, d], k [b*s, h, d, L], v [b*s, h, L, dv], slot int32 [b*j, L],
//                        index int32 []) -> [b, j, h, dv]
//     Query a of sentence r attends to the positions t <= index of its history, reading position t
//     from row r*s + slot[r*j + a, t] of the cache (beam slots; s = 1 and slot 0: a plain cache).
//   aiayn_masked_attention(q [b, j, h, d], k [b, h, d, S], v [b, h, S, dv], mask pred [b, S])
//     -> [b, j, h, dv]
//     The j queries of sentence r attend to the source positions where mask[r] is true.
//   aiayn_panel_matmul(x [n, d], panels [count, d, width]) -> [n, columns], columns <= count * width
//     A decoding step's few rows times a weight matrix laid out in panels: the output layer's and every
//     decoder layer's (kernels/output_layer.py, model/dense.py).
//   aiayn_beam_extensions(logits [b, k, vocab], alive [b, k], mode int32 [b], attribute eos_id)
//     -> (values [b, n], flat indices int32 [b, n])
//     decode/beam_search.py's select_extensions (see BeamExtensionsImpl).
//
// Every call shares its work with XLA's intra-op thread pool (parallel_for): the attentions and the
// choice of candidates a sentence at a time, the products a range of panels at a time. Each part is
// computed the same way whichever thread takes it, so results do not depend on the number of threads.
//
// The attentions: softmax(q . k) weighted values in float32, q already scaled by 1/sqrt(d). Keys are stored
// positions-last, so that the scores of all positions come from vector multiply-adds along positions.
// Masked positions get weight 0, as the reference's -1e9 logits do; a row with no visible position
// averages every value, as the reference's softmax over equal -1e9 logits does.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Runs work(part) for every part in [0, parts): on the calling thread and on up to parts - 1 tasks
// scheduled on XLA's intra-op thread pool, each claiming the next part until none is left. The caller
// works too, so the call finishes even if no task ever runs (XLA may run tasks on a busy or one-thread
// pool); it returns once every claimed part is done. A task that starts after that finds nothing to claim
// and touches only the shared counters it holds. Parts must write disjoint outputs: what each computes
// does not depend on which thread runs it, so results are the same on any number of threads.
template <typename Work>
void parallel_for(ffi::ThreadPool& pool, int64_t parts, const Work& work) {
  struct Claims {
    std::atomic<int64_t> next{0}, done{0};
  };
  const auto claims = std::make_shared<Claims>();
  const auto run = [claims, parts, &work] {
    for (int64_t part; (part = claims->next.fetch_add(1, std::memory_order_relaxed)) < parts;) {
      work(part);
      claims->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), parts) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    auto task = run;   // Schedule takes its task by value
    pool.Schedule(std::move(task));
  }
  run();
  // Spins while another thread finishes its last part (parts take tens of microseconds to
  // milliseconds), then yields the CPU, in case that thread waits for this one's CPU (more threads than
  // CPUs: a process pinned to fewer, or other processes busy).
  for (int64_t spins = 0; claims->done.load(std::memory_order_acquire) < parts; ++spins) {
    if (spins < 4096) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

// Floats per block: one vector register's worth on the CPU this is compiled for (-march=native). A
// vector wider than the CPU's registers is not split into registers by GCC but passed through memory
// (with AVX2 only, 16 floats made the kernels run 3-10x slower).
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#elif defined(__AVX__)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 4;   // SSE, NEON
#endif

// kLanes floats as one value (GCC/Clang vector extensions), so that accumulators stay in registers
// across loops.
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, Vec v) { __builtin_memcpy(p, &v, sizeof(v)); }

inline Vec vmax(Vec a, Vec b) { return a > b ? a : b; }

// a * b + c: for vectors fused where the CPU has FMA (one rounding instead of two).
inline float mul_add(float a, float b, float c) { return a * b + c; }
inline Vec mul_add(Vec a, Vec b, Vec c) {
#if defined(__AVX512F__)
  __m512 x, y, z;
  __builtin_memcpy(&x, &a, sizeof(x)), __builtin_memcpy(&y, &b, sizeof(y)), __builtin_memcpy(&z, &c, sizeof(z));
  const __m512 r = _mm512_fmadd_ps(x, y, z);
#elif defined(__AVX__) && defined(__FMA__)
  __m256 x, y, z;
  __builtin_memcpy(&x, &a, sizeof(x)), __builtin_memcpy(&y, &b, sizeof(y)), __builtin_memcpy(&z, &c, sizeof(z));
  const __m256 r = _mm256_fmadd_ps(x, y, z);
#else
  const Vec r = a * b + c;
#endif
  Vec out;
  __builtin_memcpy(&out, &r, sizeof(out));
  return out;
}

// The bits of the float 2^n, n a whole number in float(s).
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));
inline int32_t power_of_two_bits(float n) { return (static_cast<int32_t>(n) + 127) << 23; }
inline Ints power_of_two_bits(Vec n) { return (__builtin_convertvector(n, Ints) + 127) << 23; }

// exp(x) for x <= 0, of a float or of every lane of a Vec, in plain arithmetic the compiler vectorizes
// (std::exp is a library call per element): x = n ln2 + r with |r| <= ln2/2, exp(r) by its Taylor series
// to r^7 (relative error below 2e-7, about one float ulp), times 2^n built in the exponent bits.
// Arguments below -87 give exp(-87) (~1.6e-38).
template <typename T>
inline T exp_nonpositive(T x) {
  const T zero = {};
  x = x < -87.0f ? zero - 87.0f : x;
  const T shifter = zero + 12582912.0f;                                  // 1.5 * 2^23: rounds to an integer
  const T n = mul_add(x, zero + 1.44269504f, shifter) - shifter;         // round(x / ln2)
  const T r = mul_add(n, zero - 1.42860677e-06f, mul_add(n, zero - 0.693145752f, x));   // ln2 in two parts
  T p = zero + 1.0f / 5040.0f;
  for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = mul_add(p, r, zero + c);
  const auto bits = power_of_two_bits(n);
  T scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The largest of x[0, count) (count >= 1).
float row_max(const float* x, int64_t count) {
  Vec part[4];
  for (auto& v : part) v = Vec{} - INFINITY;
  int64_t t = 0;
  for (; t + 4 * kLanes <= count; t += 4 * kLanes)   // four independent chains
    for (int u = 0; u < 4; ++u) part[u] = vmax(part[u], load(x + t + u * kLanes));
  for (; t + kLanes <= count; t += kLanes) part[0] = vmax(part[0], load(x + t));
  const Vec all = vmax(vmax(part[0], part[1]), vmax(part[2], part[3]));
  float top = -INFINITY;
  for (int64_t u = 0; u < kLanes; ++u) top = top > all[u] ? top : all[u];
  for (; t < count; ++t) top = top > x[t] ? top : x[t];
  return top;
}

// The softmax of scores[0, count), where positions that take no part hold -infinity, in place: their
// weight is 0. With no position taking part, every position gets the same weight (the reference's
// softmax over equal -1e9 logits).
void softmax(float* scores, int64_t count) {
  const float top = row_max(scores, count);
  int64_t t;
  if (top == -INFINITY) {
    for (t = 0; t < count; ++t) scores[t] = 1.0f / static_cast<float>(count);
    return;
  }
  float sum_part[kLanes] = {};
  for (t = 0; t + kLanes <= count; t += kLanes)
    for (int64_t u = 0; u < kLanes; ++u) {
      const float x = scores[t + u];
      scores[t + u] = x == -INFINITY ? 0.0f : exp_nonpositive(x - top);
      sum_part[u] += scores[t + u];
    }
  float sum = 0.0f;
  for (; t < count; ++t) {
    scores[t] = scores[t] == -INFINITY ? 0.0f : exp_nonpositive(scores[t] - top);
    sum += scores[t];
  }
  for (int64_t u = 0; u < kLanes; ++u) sum += sum_part[u];
  for (t = 0; t < count; ++t) scores[t] = scores[t] / sum;
}

// Independent accumulators a loop keeps going: enough to cover the multiply-add's latency on both of a
// core's vector units (4 cycles x 2 on Zen 4 and recent Intel cores), as many as AVX-512's 32 registers
// leave room for, 8 of AVX2's 16. With fewer, each multiply-add waits for the one before it: one query
// on 2 blocks (AVX2) ran the cross-attention 3x slower than on 4 blocks of AVX-512.
constexpr int64_t kChains = kLanes >= 16 ? 16 : 8;

// Blocks of kLanes positions scored together for J queries: J * blocks accumulators, at most 8 blocks
// (with the 8 blocks loaded, what the registers hold).
template <int J>
constexpr int64_t kBlocks = std::clamp<int64_t>(kChains / J, 1, 8);

// scores[a][t0, t0 + NB * kLanes) = q[a] . key_t for J queries, keys positions-last: row i of `keys`
// holds component i of every position (stride `length`). Each key row's NB blocks are one contiguous
// run, loaded once for all J queries, so that the keys are read in address order; each block is one
// vector multiply-add per component and query, accumulated in registers. Positions from `count` on are
// computed and dropped (the keys have room: t0 + NB * kLanes <= length).
template <int J, int NB>
inline void score_blocks(const float* const* q, const float* keys, int64_t d, int64_t length, int64_t t0,
                         int64_t count, float* const* scores) {
  Vec acc[NB][J] = {};
  for (int64_t i = 0; i < d; ++i) {
    const float* row = keys + i * length + t0;
    Vec rows[NB];
    for (int c = 0; c < NB; ++c) rows[c] = load(row + c * kLanes);
    for (int a = 0; a < J; ++a)
      for (int c = 0; c < NB; ++c) acc[c][a] += rows[c] * q[a][i];
  }
  for (int c = 0; c < NB; ++c) {
    const int64_t start = t0 + c * kLanes;
    for (int a = 0; a < J; ++a) {
      if (start + kLanes <= count) {
        store(scores[a] + start, acc[c][a]);
      } else if (start < count) {
        float block[kLanes];
        store(block, acc[c][a]);
        std::copy(block, block + (count - start), scores[a] + start);
      }
    }
  }
}
// scores[a][t] = q[a] . key_t for J queries and t < count (count <= length): whole blocks (also past
// `count` where the keys have room), kBlocks<J> at a time, then a scalar loop for the rest.
template <int J>
void scores_of(const float* const* q, const float* keys, int64_t d, int64_t length, int64_t count,
               float* const* scores) {
  int64_t t0 = 0;
  while (t0 < count && t0 + kLanes <= length) {
    constexpr int64_t most = kBlocks<J>;
    const int64_t blocks = std::min({most, (length - t0) / kLanes, (count - t0 + kLanes - 1) / kLanes});
    switch (blocks) {   // each case's block count capped at `most`, which `blocks` never exceeds
      case 1: score_blocks<J, 1>(q, keys, d, length, t0, count, scores); break;
      case 2: score_blocks<J, std::min<int64_t>(2, most)>(q, keys, d, length, t0, count, scores); break;
      case 3: score_blocks<J, std::min<int64_t>(3, most)>(q, keys, d, length, t0, count, scores); break;
      case 4: score_blocks<J, std::min<int64_t>(4, most)>(q, keys, d, length, t0, count, scores); break;
      case 5: score_blocks<J, std::min<int64_t>(5, most)>(q, keys, d, length, t0, count, scores); break;
      case 6: score_blocks<J, std::min<int64_t>(6, most)>(q, keys, d, length, t0, count, scores); break;
      case 7: score_blocks<J, std::min<int64_t>(7, most)>(q, keys, d, length, t0, count, scores); break;
      default: score_blocks<J, most>(q, keys, d, length, t0, count, scores); break;
    }
    t0 += blocks * kLanes;
  }
  for (int64_t t = t0; t < count; ++t)
    for (int a = 0; a < J; ++a) {
      float acc = 0.0f;
      for (int64_t i = 0; i < d; ++i) acc += q[a][i] * keys[i * length + t];
      scores[a][t] = acc;
    }
}
// The same for any number of queries, in groups of 4, 2 and 1.
void scores_of_all(const float* const* q, int64_t queries, const float* keys, int64_t d, int64_t length,
                   int64_t count, float* const* scores) {
  int64_t a = 0;
  for (; a + 4 <= queries; a += 4) scores_of<4>(q + a, keys, d, length, count, scores + a);
  for (; a + 2 <= queries; a += 2) scores_of<2>(q + a, keys, d, length, count, scores + a);
  for (; a < queries; ++a) scores_of<1>(q + a, keys, d, length, count, scores + a);
}
// out[i0, i0 + C * kLanes) = sum over t < count of weights[t] * value_t[i0, ...): each position's C blocks
// are one contiguous run of its value row, so that the values are read in address order.
template <int C, typename Values>
inline void weighted_blocks(const float* weights, Values values, int64_t count, int64_t i0, float* out) {
  Vec acc[C] = {};
  for (int64_t t = 0; t < count; ++t) {
    const float* row = values(t) + i0;
    for (int c = 0; c < C; ++c) acc[c] += load(row + c * kLanes) * weights[t];
  }
  for (int c = 0; c < C; ++c) store(out + i0 + c * kLanes, acc[c]);
}
// out[0, dv) = sum over t < count of weights[t] * value_t, value_t = values(t) (a row of dv floats):
// whole blocks, kSumBlocks at a time (8 chains of multiply-adds with AVX2, 4 wider ones with AVX-512),
// then a scalar loop for the rest.
constexpr int64_t kSumBlocks = kLanes >= 16 ? 4 : 8;
template <typename Values>
inline void weighted_sum(const float* weights, Values values, int64_t count, int64_t dv, float* out) {
  int64_t i0 = 0;
  for (; i0 + kSumBlocks * kLanes <= dv; i0 += kSumBlocks * kLanes)
    weighted_blocks<kSumBlocks>(weights, values, count, i0, out);
  switch ((dv - i0) / kLanes) {   // fewer than kSumBlocks
    case 7: weighted_blocks<7>(weights, values, count, i0, out); break;
    case 6: weighted_blocks<6>(weights, values, count, i0, out); break;
    case 5: weighted_blocks<5>(weights, values, count, i0, out); break;
    case 4: weighted_blocks<4>(weights, values, count, i0, out); break;
    case 3: weighted_blocks<3>(weights, values, count, i0, out); break;
    case 2: weighted_blocks<2>(weights, values, count, i0, out); break;
    case 1: weighted_blocks<1>(weights, values, count, i0, out); break;
    default: break;
  }
  i0 += (dv - i0) / kLanes * kLanes;
  for (int64_t i = i0; i < dv; ++i) {
    float acc = 0.0f;
    for (int64_t t = 0; t < count; ++t) acc += weights[t] * values(t)[i];
    out[i] = acc;
  }
}

ffi::Error SlotAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                             ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::S32> index,
                             ffi::ResultBuffer<ffi::F32> out) {
  const auto qs = q.dimensions(), ks = k.dimensions(), vs = v.dimensions(), ss = slot.dimensions();
  if (qs.size() != 4 || ks.size() != 4 || vs.size() != 4 || ss.size() != 2)
    return ffi::Error::InvalidArgument("aiayn_slot_attention: expected q, k, v of rank 4 and slot of rank 2");
  const int64_t b = qs[0], j = qs[1], h = qs[2], d = qs[3];
  const int64_t rows = ks[0], length = ks[3], dv = vs[3];
  if (b == 0 || rows % b || ks[1] != h || ks[2] != d || vs[0] != rows || vs[1] != h || vs[2] != length ||
      ss[0] != b * j || ss[1] != length)
    return ffi::Error::InvalidArgument("aiayn_slot_attention: shapes do not match");
  const int64_t slots = rows / b;
  const int64_t count = std::max<int64_t>(
      1, std::min<int64_t>(static_cast<int64_t>(index.typed_data()[0]) + 1, length));
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const int32_t* sp = slot.typed_data();
  float* op = out->typed_data();
  for (int64_t a = 0; a < b * j; ++a)
    for (int64_t t = 0; t < count; ++t)
      if (sp[a * length + t] < 0 || sp[a * length + t] >= slots)
        return ffi::Error::InvalidArgument("aiayn_slot_attention: a slot index is out of range");
  parallel_for(pool, b, [&](int64_t r) {   // a sentence a part
    std::vector<float> buffer(2 * j * count);
    std::vector<float*> scores(j), partial(j);
    std::vector<const float*> queries(j);
    for (int64_t a = 0; a < j; ++a) scores[a] = buffer.data() + a * count, partial[a] = scores[a] + j * count;
    for (int64_t head = 0; head < h; ++head) {
      for (int64_t a = 0; a < j; ++a) queries[a] = qp + ((r * j + a) * h + head) * d;
      // Every slot's scores for every query; each position keeps the one from the slot that holds it
      // in that query's history.
      for (int64_t s = 0; s < slots; ++s) {
        const float* keys = kp + ((r * slots + s) * h + head) * d * length;
        scores_of_all(queries.data(), j, keys, d, length, count, s == 0 ? scores.data() : partial.data());
        if (s == 0) continue;
        for (int64_t a = 0; a < j; ++a) {
          const int32_t* history = sp + (r * j + a) * length;
          float* kept = scores[a];
          const float* fresh = partial[a];
          for (int64_t t = 0; t < count; ++t) {   // both read unconditionally: a vector blend
            const float x = fresh[t], y = kept[t];
            kept[t] = history[t] == s ? x : y;
          }
        }
      }
      for (int64_t a = 0; a < j; ++a) {
        const int32_t* history = sp + (r * j + a) * length;
        softmax(scores[a], count);
        auto values = [&](int64_t t) { return vp + (((r * slots + history[t]) * h + head) * length + t) * dv; };
        weighted_sum(scores[a], values, count, dv, op + ((r * j + a) * h + head) * dv);
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error MaskedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                               ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out) {
  const auto qs = q.dimensions(), ks = k.dimensions(), vs = v.dimensions(), ms = mask.dimensions();
  if (qs.size() != 4 || ks.size() != 4 || vs.size() != 4 || ms.size() != 2)
    return ffi::Error::InvalidArgument("aiayn_masked_attention: expected q, k, v of rank 4 and mask of rank 2");
  const int64_t b = qs[0], j = qs[1], h = qs[2], d = qs[3];
  const int64_t length = ks[3], dv = vs[3];
  if (ks[0] != b || ks[1] != h || ks[2] != d || vs[0] != b || vs[1] != h || vs[2] != length ||
      ms[0] != b || ms[1] != length || length == 0)
    return ffi::Error::InvalidArgument("aiayn_masked_attention: shapes do not match");
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  parallel_for(pool, b, [&](int64_t r) {   // a sentence a part
    std::vector<float> buffer(j * length);
    std::vector<float*> scores(j);
    std::vector<const float*> queries(j);
    for (int64_t a = 0; a < j; ++a) scores[a] = buffer.data() + a * length;
    const bool* visible = mp + r * length;
    for (int64_t head = 0; head < h; ++head) {
      const float* keys = kp + (r * h + head) * d * length;
      const float* values = vp + (r * h + head) * length * dv;
      for (int64_t a = 0; a < j; ++a) queries[a] = qp + ((r * j + a) * h + head) * d;
      scores_of_all(queries.data(), j, keys, d, length, length, scores.data());
      for (int64_t a = 0; a < j; ++a) {
        for (int64_t t = 0; t < length; ++t) scores[a][t] = visible[t] ? scores[a][t] : -INFINITY;
        softmax(scores[a], length);
        weighted_sum(scores[a], [&](int64_t t) { return values + t * dv; }, length, dv,
                     op + ((r * j + a) * h + head) * dv);
      }
    }
  });
  return ffi::Error::Success();
}

// ---- The few rows of a decoding step times a weight matrix ----

// Columns per panel: two vector registers. kernels/output_layer.py lays a [d, columns] matrix out once
// per batch as panels [ceil(columns / kPanel), d, kPanel] (zeros past the columns): the output layer's
// table and the decoder's kernels (model/dense.py). One panel's weights are one contiguous run read in
// order, and each weight is loaded once for up to 8 rows.
constexpr int64_t kPanel = 2 * kLanes;

// Rows per pass over the panels: 2 accumulators a row, 16 of AVX-512's 32 vector registers, 8 of
// AVX2's 16.
constexpr int64_t kPanelRows = kLanes >= 16 ? 8 : 4;

// The bytes of panels one thread takes at a time (a quarter of a Zen 4 core's L2).
constexpr int64_t kPartBytes = 256 * 1024;

// out[m, p * kPanel + c] = sum over i of x[m, i] * panels[p, i, c], for M <= kPanelRows rows, the sum
// in order of i; out's rows are `stride` apart and `columns` of each are written (the last panel's
// past them are dropped).
template <int M>
void panel_rows(const float* x, const float* panels, int64_t d, int64_t count, float* out, int64_t columns,
                int64_t stride) {
  for (int64_t p = 0; p < count; ++p) {
    const float* w = panels + p * d * kPanel;
    Vec acc[M][2] = {};
    for (int64_t i = 0; i < d; ++i) {
      const Vec w0 = load(w + i * kPanel), w1 = load(w + i * kPanel + kLanes);
      for (int m = 0; m < M; ++m) {
        const float xm = x[m * d + i];
        acc[m][0] += w0 * xm;
        acc[m][1] += w1 * xm;
      }
    }
    const int64_t start = p * kPanel;
    for (int m = 0; m < M; ++m) {
      float* row = out + m * stride + start;
      if (start + kPanel <= columns) {
        store(row, acc[m][0]);
        store(row + kLanes, acc[m][1]);
      } else {
        float block[kPanel];
        store(block, acc[m][0]);
        store(block + kLanes, acc[m][1]);
        std::copy(block, block + (columns - start), row);
      }
    }
  }
}

ffi::Error PanelMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto xs = x.dimensions(), ps = panels.dimensions(), os = out->dimensions();
  if (xs.size() != 2 || ps.size() != 3 || os.size() != 2)
    return ffi::Error::InvalidArgument("aiayn_panel_matmul: expected x of rank 2, panels of rank 3");
  const int64_t n = xs[0], d = xs[1], count = ps[0];
  const int64_t columns = os[1];
  if (ps[1] != d || ps[2] != kPanel || os[0] != n || columns > count * kPanel ||
      columns <= (count - 1) * kPanel)
    return ffi::Error::InvalidArgument("aiayn_panel_matmul: shapes do not match (panels must be "
                                       "[count, d, aiayn_panel_width()], out [n, columns] with columns "
                                       "in the last panel)");
  const float* xp = x.typed_data();
  const float* pp = panels.typed_data();
  float* op = out->typed_data();
  // Ranges of whole panels of about kPartBytes each (at least one range per thread where there are
  // panels enough), so that a range stays in a core's L2 while every group of rows passes over it.
  const int64_t panel_bytes = d * kPanel * static_cast<int64_t>(sizeof(float));
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts = std::min(count, std::max((count * panel_bytes + kPartBytes - 1) / kPartBytes, threads));
  parallel_for(pool, parts, [&](int64_t part) {
    const int64_t first = count * part / parts, last = count * (part + 1) / parts;
    const float* pr = pp + first * d * kPanel;
    const int64_t width = std::min(columns, last * kPanel) - first * kPanel;
    int64_t m0 = 0;
    for (; m0 + kPanelRows <= n; m0 += kPanelRows)
      panel_rows<kPanelRows>(xp + m0 * d, pr, d, last - first, op + m0 * columns + first * kPanel, width, columns);
    const float* xr = xp + m0 * d;
    float* orow = op + m0 * columns + first * kPanel;
    switch (n - m0) {   // fewer than kPanelRows
      case 7: panel_rows<7>(xr, pr, d, last - first, orow, width, columns); break;
      case 6: panel_rows<6>(xr, pr, d, last - first, orow, width, columns); break;
      case 5: panel_rows<5>(xr, pr, d, last - first, orow, width, columns); break;
      case 4: panel_rows<4>(xr, pr, d, last - first, orow, width, columns); break;
      case 3: panel_rows<3>(xr, pr, d, last - first, orow, width, columns); break;
      case 2: panel_rows<2>(xr, pr, d, last - first, orow, width, columns); break;
      case 1: panel_rows<1>(xr, pr, d, last - first, orow, width, columns); break;
      default: break;
    }
  });
  return ffi::Error::Success();
}

// ---- Beam search's candidate extensions ----

// Sentence modes (decode/beam_search.py): what the step may append.
constexpr int32_t kFree = 0, kNoEos = 1, kOnlyEos = 2, kDead = 3;
constexpr float kNegInf = -1.0e9f;   // decode/beam_search.py's NEG_INF

// The n best (value, index) pairs offered so far, best first. Indices must be offered in increasing
// order: a value equal to one already kept then ranks after it, so ties go to the lower index (as
// jax.lax.top_k's do).
struct Best {
  float* value;
  int32_t* index;
  int64_t n, size = 0;

  float worst() const { return size < n ? -INFINITY : value[n - 1]; }
  bool full() const { return size == n; }
  void offer(float v, int32_t i) {
    if (size == n && !(v > value[n - 1])) return;
    int64_t p = size < n ? size++ : n - 1;
    for (; p > 0 && v > value[p - 1]; --p) value[p] = value[p - 1], index[p] = index[p - 1];
    value[p] = v, index[p] = i;
  }
};

// sum over t of exp(x[t] - top), every x[t] <= top.
float exp_sum(const float* x, int64_t count, float top) {
  Vec part[4] = {};
  int64_t t = 0;
  for (; t + 4 * kLanes <= count; t += 4 * kLanes)   // four independent chains
    for (int u = 0; u < 4; ++u) part[u] += exp_nonpositive(load(x + t + u * kLanes) - top);
  for (; t + kLanes <= count; t += kLanes) part[0] += exp_nonpositive(load(x + t) - top);
  const Vec all = (part[0] + part[1]) + (part[2] + part[3]);
  float sum = 0.0f;
  for (int64_t u = 0; u < kLanes; ++u) sum += all[u];
  for (; t < count; ++t) sum += exp_nonpositive(x[t] - top);
  return sum;
}

// A bit per lane: bit u set where v[u] > bound.
inline uint32_t lanes_above(Vec v, float bound) {
#if defined(__AVX512F__)
  __m512 m;
  __builtin_memcpy(&m, &v, sizeof(m));
  return _mm512_cmp_ps_mask(m, _mm512_set1_ps(bound), _CMP_GT_OQ);
#elif defined(__AVX__)
  __m256 m;
  __builtin_memcpy(&m, &v, sizeof(m));
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(m, _mm256_set1_ps(bound), _CMP_GT_OQ)));
#else
  uint32_t bits = 0;
  for (int64_t u = 0; u < kLanes; ++u) bits |= static_cast<uint32_t>(v[u] > bound) << u;
  return bits;
#endif
}

// For every sentence r: the n best of total[j, t] = alive[r, j] + logp[r, j, t] over its k hypotheses j
// and the vocabulary t, logp = log_softmax(logits[r, j]) computed as (x - max) - log(sum exp(x - max)),
// with mode kNoEos giving eos NEG_INF, kOnlyEos every other token NEG_INF, kDead every total NEG_INF.
// Values best first, ties to the lower flat index j * vocab + t: decode/beam_search.py's
// select_extensions, up to the rounding of the exponentials.
//
// Each row is read three times: its maximum, the sum of exponentials, then the scan for candidates.
// The scan skips most of the row a block of 4 vectors at a time; the exact totals are computed only
// where a block might hold one of the n best (about n log(k * vocab / n) entries in all, for logits
// in random order).
void beam_extensions(ffi::ThreadPool& pool, const float* lp, const float* ap, const int32_t* mp, int64_t b,
                     int64_t k, int64_t vocab, int64_t n, int32_t eos_id, float* vp, int32_t* ip) {
  const int64_t block = 4 * kLanes;
  parallel_for(pool, b, [&](int64_t r) {   // a sentence a part
    Best best{vp + r * n, ip + r * n, n};
    const int32_t m = mp[r];
    if (m == kDead) {   // every total NEG_INF: the n lowest indices
      for (int64_t i = 0; i < n; ++i) best.value[i] = kNegInf, best.index[i] = static_cast<int32_t>(i);
      return;
    }
    for (int64_t j = 0; j < k; ++j) {
      const float* x = lp + (r * k + j) * vocab;
      const float a = ap[r * k + j];
      const float top = row_max(x, vocab);
      const float lse = std::log(exp_sum(x, vocab, top));
      const int32_t base = static_cast<int32_t>(j * vocab);
      auto total = [&](int64_t t) {
        const bool masked = (m == kOnlyEos && t != eos_id) || (m == kNoEos && t == eos_id);
        return a + (masked ? kNegInf : (x[t] - top) - lse);
      };
      if (m == kOnlyEos) {   // a sentence's last step: every token, one at a time
        for (int64_t t = 0; t < vocab; ++t) best.offer(total(t), base + static_cast<int32_t>(t));
        continue;
      }
      // Blocks of 4 vectors: one compare of their largest raw logit against the raw value the current
      // n-th best maps back to (less a margin far above the rounding between the two) skips most; the
      // totals of a block that passes are compared exactly, lane by lane, in vectors.
      int64_t t0 = 0;
      for (; t0 + block <= vocab; t0 += block) {
        const float worst = best.worst();
        if (best.full()) {
          const float raw = worst - a + lse + top;
          const float margin = 1e-5f * (std::fabs(worst) + std::fabs(a) + std::fabs(lse) + std::fabs(top));
          const Vec most = vmax(vmax(load(x + t0), load(x + t0 + kLanes)),
                                vmax(load(x + t0 + 2 * kLanes), load(x + t0 + 3 * kLanes)));
          if (!lanes_above(most, raw - margin)) continue;
        }
        for (int64_t t = t0; t < t0 + block; t += kLanes) {
          Vec totals = a + ((load(x + t) - top) - lse);   // total(t + u) in lane u, rounded alike
          if (m == kNoEos && eos_id >= t && eos_id < t + kLanes) totals[eos_id - t] = a + kNegInf;
          for (uint32_t bits = lanes_above(totals, best.worst()); bits; bits &= bits - 1) {
            const int u = __builtin_ctz(bits);
            best.offer(totals[u], base + static_cast<int32_t>(t + u));
          }
        }
      }
      for (int64_t t = t0; t < vocab; ++t) best.offer(total(t), base + static_cast<int32_t>(t));
    }
    // NaN totals (logits with NaN or infinity) are never offered: fill what they left empty with NaN
    // at the lowest indices, so that every result is written and every index is in range.
    for (int64_t i = best.size; i < n; ++i) best.value[i] = NAN, best.index[i] = static_cast<int32_t>(i);
  });
}

ffi::Error BeamExtensionsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> alive,
                              ffi::Buffer<ffi::S32> mode, int32_t eos_id,
                              ffi::ResultBuffer<ffi::F32> values, ffi::ResultBuffer<ffi::S32> indices) {
  const auto ls = logits.dimensions(), as = alive.dimensions(), ms = mode.dimensions(),
             vs = values->dimensions(), is = indices->dimensions();
  if (ls.size() != 3 || as.size() != 2 || ms.size() != 1 || vs.size() != 2 || is.size() != 2)
    return ffi::Error::InvalidArgument("aiayn_beam_extensions: expected logits of rank 3, alive and the "
                                       "results of rank 2, mode of rank 1");
  const int64_t b = ls[0], k = ls[1], vocab = ls[2], n = vs[1];
  if (as[0] != b || as[1] != k || ms[0] != b || vs[0] != b || is[0] != b || is[1] != n)
    return ffi::Error::InvalidArgument("aiayn_beam_extensions: shapes do not match");
  if (vocab < 1 || n < 1 || n > k * vocab || k * vocab > INT32_MAX)
    return ffi::Error::InvalidArgument("aiayn_beam_extensions: need 1 <= n <= k * vocab < 2^31");
  beam_extensions(pool, logits.typed_data(), alive.typed_data(), mode.typed_data(), b, k, vocab, n, eos_id,
                  values->typed_data(), indices->typed_data());
  return ffi::Error::Success();
}

}  // namespace

// The panel width kernels/output_layer.py lays the table out in (read through ctypes).
extern "C" int64_t aiayn_panel_width() { return kPanel; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(AiaynPanelMatmul, PanelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AiaynSlotAttention, SlotAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AiaynMaskedAttention, MaskedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AiaynBeamExtensions, BeamExtensionsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("eos_id")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
