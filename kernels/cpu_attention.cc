// Decoding-step attention for XLA:CPU as two XLA FFI custom calls (kernels/cpu_attention.py builds and
// registers them). One call does what XLA runs as a dozen small ops (scores, mask, max, exp, sum,
// divide, weighted sum, and the transposes between them), each of which costs a dispatch.
//
//   aiayn_slot_attention(q [b, j, h, d], k [b*s, h, d, L], v [b*s, h, L, dv], slot int32 [b*j, L],
//                        index int32 []) -> [b, j, h, dv]
//     Query a of sentence r attends to the positions t <= index of its history, reading position t
//     from row r*s + slot[r*j + a, t] of the cache (beam slots; s = 1 and slot 0: a plain cache).
//   aiayn_masked_attention(q [b, j, h, d], k [b, h, d, S], v [b, h, S, dv], mask pred [b, S])
//     -> [b, j, h, dv]
//     The j queries of sentence r attend to the source positions where mask[r] is true.
//
// Both: softmax(q . k) weighted values in float32, q already scaled by 1/sqrt(d). Keys are stored
// positions-last, so that the scores of all positions come from vector multiply-adds along positions.
// Masked positions get weight 0, as the reference's -1e9 logits do; a row with no visible position
// averages every value, as the reference's softmax over equal -1e9 logits does.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// exp(x) for x <= 0 in plain arithmetic the compiler vectorizes (std::exp is a library call per element):
// x = n ln2 + r with |r| <= ln2/2, exp(r) by its Taylor series to r^7 (relative error below 2e-7, about
// one float ulp), times 2^n built in the exponent bits. Arguments below -87 give exp(-87) (~1.6e-38).
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float shifter = 12582912.0f;                      // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504f + shifter) - shifter;  // round(x / ln2)
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-06f;   // ln2 in two parts
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
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

// The softmax of scores[0, count), where positions that take no part hold -infinity, in place: their
// weight is 0. With no position taking part, every position gets the same weight (the reference's
// softmax over equal -1e9 logits).
void softmax(float* scores, int64_t count) {
  float top_part[kLanes];
  for (int64_t u = 0; u < kLanes; ++u) top_part[u] = -INFINITY;
  int64_t t = 0;
  for (; t + kLanes <= count; t += kLanes)
    for (int64_t u = 0; u < kLanes; ++u) top_part[u] = top_part[u] > scores[t + u] ? top_part[u] : scores[t + u];
  float top = -INFINITY;
  for (; t < count; ++t) top = top > scores[t] ? top : scores[t];
  for (int64_t u = 0; u < kLanes; ++u) top = top > top_part[u] ? top : top_part[u];
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

// scores[a][t] = q[a] . key_t for J queries and t < count (count <= length), keys positions-last: row i
// of `keys` holds component i of every position (stride `length`). A block of kLanes positions is one
// vector multiply-add per component and query, accumulated in registers, each key row loaded once for
// all J queries.
template <int J>
void scores_of(const float* const* q, const float* keys, int64_t d, int64_t length, int64_t count,
               float* const* scores) {
  int64_t t0 = 0;
  // Whole blocks, also past `count` where the keys have room (those scores are computed and dropped).
  for (; t0 < count && t0 + kLanes <= length; t0 += kLanes) {
    Vec acc[J] = {};
    for (int64_t i = 0; i < d; ++i) {
      const Vec row = load(keys + i * length + t0);
      for (int a = 0; a < J; ++a) acc[a] += row * q[a][i];
    }
    for (int a = 0; a < J; ++a) {
      if (t0 + kLanes <= count) {
        store(scores[a] + t0, acc[a]);
      } else {
        float block[kLanes];
        store(block, acc[a]);
        std::copy(block, block + (count - t0), scores[a] + t0);
      }
    }
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

// out[0, dv) = sum over t < count of weights[t] * value_t, value_t = values(t) (a row of dv floats).
template <typename Values>
inline void weighted_sum(const float* weights, Values values, int64_t count, int64_t dv, float* out) {
  int64_t i0 = 0;
  for (; i0 + kLanes <= dv; i0 += kLanes) {
    Vec acc = {};
    for (int64_t t = 0; t < count; ++t) acc += load(values(t) + i0) * weights[t];
    store(out + i0, acc);
  }
  for (int64_t i = i0; i < dv; ++i) {
    float acc = 0.0f;
    for (int64_t t = 0; t < count; ++t) acc += weights[t] * values(t)[i];
    out[i] = acc;
  }
}

ffi::Error SlotAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
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
  std::vector<float> buffer(2 * j * count);
  std::vector<float*> scores(j), partial(j);
  std::vector<const float*> queries(j);
  for (int64_t a = 0; a < j; ++a) scores[a] = buffer.data() + a * count, partial[a] = scores[a] + j * count;
  for (int64_t r = 0; r < b; ++r) {
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
  }
  return ffi::Error::Success();
}

ffi::Error MaskedAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
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
  std::vector<float> buffer(j * length);
  std::vector<float*> scores(j);
  std::vector<const float*> queries(j);
  for (int64_t a = 0; a < j; ++a) scores[a] = buffer.data() + a * length;
  for (int64_t r = 0; r < b; ++r) {
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
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AiaynSlotAttention, SlotAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AiaynMaskedAttention, MaskedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
