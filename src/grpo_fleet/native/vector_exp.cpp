// exp as an MLX primitive whose CPU kernel is vectorized (AVX2 + FMA where the CPU has them).
//
// MLX's own CPU exp is scalar on x86: its polynomial calls std::fma per term, and
// without FMA in the baseline ISA each of those is a library call. Here it ran at
// 63-68 M values/s against NumPy's 546 M on one core, and a long row's step takes
// the exp of every attention score, every vocabulary logit at a completion
// position and every SiLU input (bench/RESULTS.md). This primitive is lazy like
// any MLX op, so it can sit inside a traced gradient: its VJP is the cotangent
// times its own output.
//
// The polynomial is Cephes' expf (as SSE/AVX "mathfun" ports carry it): x = n ln2 + r,
// exp(r) by a degree-6 polynomial, 2^n built in the exponent bits.

#include <cmath>
#include <cstring>
#include <stdexcept>

#include <nanobind/nanobind.h>

#include "mlx/backend/common/unary.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GRPO_FLEET_X86 1
#endif

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kMaxArg = 88.72283935546875f;  // ln(FLT_MAX): above it exp overflows to inf
constexpr float kMinArg = -87.33654475f;       // ln(FLT_MIN): below it exp is flushed to 0, as MLX's is
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

void exp_scalar(const float* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float x = in[i];
    out[i] = x < kMinArg ? 0.0f : std::exp(x);
  }
}

#ifdef GRPO_FLEET_X86
__attribute__((target("avx2,fma"))) void exp_avx2(const float* in, float* out, size_t n) {
  const __m256 lo = _mm256_set1_ps(kMinArg), hi = _mm256_set1_ps(kMaxArg);
  const __m256 log2e = _mm256_set1_ps(kLog2e), ln2_hi = _mm256_set1_ps(kLn2Hi), ln2_lo = _mm256_set1_ps(kLn2Lo);
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps(), inf = _mm256_set1_ps(INFINITY);
  const __m256i bias = _mm256_set1_epi32(127);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x_in = _mm256_loadu_ps(in + i);
    const __m256 x = _mm256_min_ps(_mm256_max_ps(x_in, lo), hi);
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, ln2_hi, x);  // r = x - k ln2, ln2 in two parts to keep r exact
    r = _mm256_fnmadd_ps(k, ln2_lo, r);
    __m256 p = _mm256_set1_ps(kP[0]);
    for (int j = 1; j < 6; ++j) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP[j]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, one));
    // 2^k as two factors 2^(k/2) and 2^(k - k/2): k reaches 128 at ln(FLT_MAX), past one float's exponent
    const __m256i ki = _mm256_cvtps_epi32(k);
    const __m256i half = _mm256_srai_epi32(ki, 1);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ki, half), bias), 23));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    y = _mm256_blendv_ps(y, inf, _mm256_cmp_ps(x_in, hi, _CMP_GT_OQ));
    y = _mm256_blendv_ps(y, zero, _mm256_cmp_ps(x_in, lo, _CMP_LT_OQ));
    y = _mm256_blendv_ps(y, x_in, _mm256_cmp_ps(x_in, x_in, _CMP_UNORD_Q));  // NaN stays NaN
    _mm256_storeu_ps(out + i, y);
  }
  exp_scalar(in + i, out + i, n - i);
}

bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

void exp_float32(const float* in, float* out, size_t n) {
#ifdef GRPO_FLEET_X86
  if (has_avx2_fma()) return exp_avx2(in, out, n);
#endif
  exp_scalar(in, out, n);
}

const char* kernel_name() {
#ifdef GRPO_FLEET_X86
  if (has_avx2_fma()) return "avx2-fma";
#endif
  return "scalar";
}

mx::array vector_exp(const mx::array& x);

class VectorExp : public mx::UnaryPrimitive {
 public:
  explicit VectorExp(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& in = inputs[0];
    if (in.dtype() != mx::float32 || !in.flags().contiguous) {
      throw std::invalid_argument("[VectorExp] takes a contiguous float32 array");
    }
    mx::set_unary_output_data(in, out);  // in place when the input may be donated
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(in);
    encoder.set_output_array(out);
    encoder.dispatch([in = mx::array::unsafe_weak_copy(in), out = mx::array::unsafe_weak_copy(out)]() mutable {
      exp_float32(in.data<float>(), out.data<float>(), in.data_size());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[VectorExp] has no GPU kernel: MLX's exp is the one to use there");
  }

  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>& tangents,
                             const std::vector<int>&) override {
    return {mx::multiply(tangents[0], vector_exp(primals[0]), stream())};
  }

  std::vector<mx::array> vjp(const std::vector<mx::array>&, const std::vector<mx::array>& cotangents,
                             const std::vector<int>&, const std::vector<mx::array>& outputs) override {
    return {mx::multiply(cotangents[0], outputs[0], stream())};
  }

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array>& inputs,
                                                           const std::vector<int>& axes) override {
    return {{vector_exp(inputs[0])}, axes};
  }

  const char* name() const override { return "VectorExp"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
};

mx::array vector_exp(const mx::array& x) {
  if (x.dtype() != mx::float32) {
    throw std::invalid_argument("vector_exp takes float32 arrays");
  }
  const mx::Stream stream = mx::default_stream(mx::Device::cpu);
  const mx::array dense = mx::contiguous(x, /* allow_col_major = */ true, stream);
  return mx::array(dense.shape(), mx::float32, std::make_shared<VectorExp>(stream), {dense});
}

}  // namespace

NB_MODULE(_vector_exp, m) {
  m.doc() = "exp as an MLX primitive with a vectorized CPU kernel (grpo_fleet/native/vector_exp.cpp).";
  m.def("exp", &vector_exp, nb::arg("x"), "exp(x) of a float32 array, on the CPU stream; its VJP is cotangent * exp(x).");
  m.def("kernel", &kernel_name, "Which loop runs: 'avx2-fma' or 'scalar'.");
}
