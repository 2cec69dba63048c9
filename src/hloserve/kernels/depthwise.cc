// A depthwise 2-D convolution (one filter per channel), NHWC float32, as an XLA FFI handler.
//
// XLA:CPU computes these as a sum of strided slices (its grouped convolution is slower still);
// here each output row accumulates its taps with the channel axis innermost, so every tap is one
// vectorized multiply-add over contiguous channels, and rows are split over XLA's intra-op pool.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Geometry {
  int64_t n, h, w, c, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw;
};

// Output rows [first, last) of the N*OH rows.
__attribute__((target_clones("avx512f", "avx2", "default"))) void Rows(
    const Geometry& g, const float* __restrict x, const float* __restrict k,
    float* __restrict y, int64_t first, int64_t last) {
  const int64_t c = g.c;
  for (int64_t r = first; r < last; ++r) {
    const int64_t n = r / g.oh, oh = r % g.oh;
    float* __restrict out = y + r * g.ow * c;
    std::fill(out, out + g.ow * c, 0.0f);
    for (int64_t i = 0; i < g.kh; ++i) {
      const int64_t ih = oh * g.sh - g.ph + i * g.dh;
      if (ih < 0 || ih >= g.h) continue;
      const float* __restrict in = x + (n * g.h + ih) * g.w * c;
      for (int64_t j = 0; j < g.kw; ++j) {
        const float* __restrict tap = k + (i * g.kw + j) * c;
        const int64_t offset = j * g.dw - g.pw;  // input column = output column * sw + offset
        const int64_t lo = offset >= 0 ? 0 : (-offset + g.sw - 1) / g.sw;
        const int64_t hi = g.w - 1 - offset < 0 ? 0 : std::min(g.ow, (g.w - 1 - offset) / g.sw + 1);
        for (int64_t o = lo; o < hi; ++o) {
          float* __restrict dst = out + o * c;
          const float* __restrict src = in + (o * g.sw + offset) * c;
          for (int64_t ch = 0; ch < c; ++ch) dst[ch] += src[ch] * tap[ch];
        }
      }
    }
  }
}

// Chunks of rows claimed from a counter by the calling thread and by tasks on XLA's pool. The
// caller waits only for chunks already claimed, which are running, so a busy pool never
// deadlocks it; a task that starts after the last chunk was claimed finds nothing to do.
struct Split {
  Geometry g;
  const float* x;
  const float* k;
  float* y;
  int64_t chunks, rows_per_chunk;
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mutex;
  std::condition_variable finished;

  void Drain() {
    for (int64_t i; (i = next.fetch_add(1)) < chunks;) {
      const int64_t first = i * rows_per_chunk;
      Rows(g, x, k, y, first, std::min(first + rows_per_chunk, g.n * g.oh));
      if (done.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(mutex);
        finished.notify_all();
      }
    }
  }
};

ffi::Error Depthwise(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> k,
                     ffi::ResultBuffer<ffi::F32> y, int64_t stride_h, int64_t stride_w,
                     int64_t pad_h, int64_t pad_w, int64_t dilation_h, int64_t dilation_w) {
  const auto xd = x.dimensions(), kd = k.dimensions(), yd = y->dimensions();
  if (xd.size() != 4 || kd.size() != 3 || yd.size() != 4 || kd[2] != xd[3] || yd[0] != xd[0] ||
      yd[3] != xd[3])
    return ffi::Error::InvalidArgument(
        "hloserve.depthwise_conv2d takes x (N, H, W, C) and taps (KH, KW, C) to (N, OH, OW, C)");
  // Bounded so that no index below can overflow, whatever a bundle's attributes say.
  constexpr int64_t kMost = int64_t{1} << 20;
  for (int64_t v : {stride_h, stride_w, dilation_h, dilation_w, pad_h + 1, pad_w + 1})
    if (v < 1 || v > kMost)
      return ffi::Error::InvalidArgument(
          "hloserve.depthwise_conv2d: strides and dilations 1 to 2^20, padding 0 to 2^20 - 1");
  for (int64_t v : {xd[0], xd[1], xd[2], xd[3], kd[0], kd[1], yd[1], yd[2]})
    if (v > kMost * 64)
      return ffi::Error::InvalidArgument("hloserve.depthwise_conv2d: a dimension above 2^26");
  auto split = std::make_shared<Split>();
  split->g = {xd[0], xd[1], xd[2], xd[3], yd[1], yd[2], kd[0], kd[1],
              stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w};
  split->x = x.typed_data();
  split->k = k.typed_data();
  split->y = y->typed_data();
  const int64_t rows = xd[0] * yd[1];
  if (rows == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  split->rows_per_chunk = (rows + threads * 4 - 1) / (threads * 4);
  split->chunks = (rows + split->rows_per_chunk - 1) / split->rows_per_chunk;
  for (int64_t t = 1; t < std::min(threads, split->chunks); ++t)
    pool.Schedule([split] { split->Drain(); });
  split->Drain();
  std::unique_lock<std::mutex> lock(split->mutex);
  split->finished.wait(lock, [&] { return split->done.load() == split->chunks; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HloserveDepthwiseConv2d, Depthwise,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("stride_h")
                                  .Attr<int64_t>("stride_w")
                                  .Attr<int64_t>("pad_h")
                                  .Attr<int64_t>("pad_w")
                                  .Attr<int64_t>("dilation_h")
                                  .Attr<int64_t>("dilation_w"));
