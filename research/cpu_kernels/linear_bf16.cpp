#include <torch/extension.h>
#include <immintrin.h>

// out[m, n] = bf16(sum_k x[m, k] * w[n, k] (+ bias[n])), fp32 accumulation, for M <= 8 rows of x:
// the weight is streamed once, row after row (sequential reads), each row against every x row.
template <int M>
static void rows(const uint16_t* X, const uint16_t* W, const uint16_t* B, uint16_t* Y, int64_t N, int64_t K) {
  const int64_t full = K / 32 * 32;
  const __mmask32 tail = (__mmask32)((1ull << (K - full)) - 1);
  for (int64_t n = 0; n < N; ++n) {
    const uint16_t* row = W + n * K;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < full; k += 32) {
      __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(row + k));
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512((const void*)(X + m * K + k)));
    }
    if (k < K) {
      __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, (const void*)(row + k));
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_maskz_loadu_epi16(tail, (const void*)(X + m * K + k)));
    }
    float b = 0.f;
    if (B) { uint32_t bits = (uint32_t)B[n] << 16; memcpy(&b, &bits, 4); }
    for (int m = 0; m < M; ++m) {
      float v = _mm512_reduce_add_ps(acc[m]) + b;
      // round to nearest even, as torch's float -> bfloat16
      uint32_t u; memcpy(&u, &v, 4);
      uint16_t h = (v != v) ? 0x7fc0 : (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
      Y[m * N + n] = h;
    }
  }
}

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16, "bf16 only");
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "shapes");
  auto xc = x.reshape({-1, x.size(-1)}).contiguous();
  auto wc = w.contiguous();
  const int64_t M = xc.size(0), N = wc.size(0), K = wc.size(1);
  TORCH_CHECK(M >= 1 && M <= 8, "1 to 8 rows");
  auto sizes = x.sizes().vec(); sizes.back() = N;
  auto y = torch::empty({M, N}, x.options());
  const uint16_t* X = (const uint16_t*)xc.data_ptr();
  const uint16_t* W = (const uint16_t*)wc.data_ptr();
  torch::Tensor bc;
  const uint16_t* B = nullptr;
  if (bias.has_value() && bias->defined()) { bc = bias->contiguous(); B = (const uint16_t*)bc.data_ptr(); }
  uint16_t* Y = (uint16_t*)y.data_ptr();
  switch (M) {
    case 1: rows<1>(X, W, B, Y, N, K); break; case 2: rows<2>(X, W, B, Y, N, K); break;
    case 3: rows<3>(X, W, B, Y, N, K); break; case 4: rows<4>(X, W, B, Y, N, K); break;
    case 5: rows<5>(X, W, B, Y, N, K); break; case 6: rows<6>(X, W, B, Y, N, K); break;
    case 7: rows<7>(X, W, B, Y, N, K); break; default: rows<8>(X, W, B, Y, N, K); break;
  }
  return y.view(sizes);
}
