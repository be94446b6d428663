// kvq.quantize / kvq.dequantize: argument checks, output allocation and the CPU
// implementation (the CUDA one is in cuda_bindings.cpp and shares prepare_*()).
#include <ATen/Parallel.h>

#include "ops.h"
#include "utils.h"

namespace kvq {

void raise_status(const char* op, const char* arg, int32_t status, const char* out_of_range) {
  KVQ_CHECK(!(status & kStatusNonFinite), "kvq.", op, ": argument '", arg,
              "' contains NaN or Inf; compress finite tensors only (pass check_finite=False to "
              "skip this check, in which case a non-finite entry spoils its own group)");
  KVQ_CHECK(!(status & kStatusOutOfRange), "kvq.", op, ": argument '", arg, "' ", out_of_range);
}

static void check_head_dim(const char* op, const char* arg, int64_t D, int64_t bits) {
  KVQ_CHECK_ARG(supported_head_dim(D), op, arg,
                "must have a last (head) dimension of ", kHeadDimsText, ", got ", D);
  (void)bits;
}

QuantizeCall prepare_quantize(const at::Tensor& x_in, int64_t bits, int64_t group_size,
                              bool per_channel, bool check_finite) {
  const char* op = "quantize";
  CHECK_FLOATING(op, x_in, "x");
  CHECK_MIN_DIM(op, x_in, "x", 2);
  KVQ_CHECK_ARG(supported_bits(bits), op, "bits", "must be ", kBitsText, ", got ", bits);
  const int64_t T = x_in.size(-2), D = x_in.size(-1);
  check_head_dim(op, "x", D, bits);
  KVQ_CHECK_ARG(group_size == -1 || group_size > 0, op, "group_size",
                "must be positive or -1 (whole axis), got ", group_size);
  int64_t G;
  if (per_channel) {
    G = group_size == -1 ? T : group_size;
    KVQ_CHECK_ARG(T == 0 || T % G == 0, op, "group_size",
                  "must divide the token count for per-channel grouping: T=", T,
                  " is not a multiple of ", G);
  } else {
    G = group_size == -1 ? D : group_size;
    KVQ_CHECK_ARG(D % G == 0, op, "group_size", "must divide the head dim for per-token grouping: D=",
                  D, " is not a multiple of ", G);
    KVQ_CHECK_ARG(G >= 8 && (G & (G - 1)) == 0, op, "group_size",
                  "must be a power of two >= 8 for per-token grouping, got ", G);
  }
  QuantizeCall c;
  c.x = contiguous_aligned(x_in);
  const int64_t N = leading_numel(c.x, 2);
  auto lead = c.x.sizes().slice(0, c.x.dim() - 2).vec();
  auto opts16 = c.x.options().dtype(at::kHalf);
  auto codes_shape = lead;
  codes_shape.push_back(T);
  codes_shape.push_back(D * bits / 32);
  c.codes = at::empty(codes_shape, c.x.options().dtype(at::kInt));
  auto sshape = lead;
  if (per_channel) {
    sshape.push_back(G > 0 ? T / G : 0);
    sshape.push_back(D);
  } else {
    sshape.push_back(T);
    sshape.push_back(D / G);
  }
  c.scale = at::empty(sshape, opts16);
  c.zero = at::empty(sshape, opts16);
  if (check_finite) c.status = at::zeros({1}, c.x.options().dtype(at::kInt));
  auto& p = c.params;
  p.x = c.x.data_ptr();
  p.codes = c.codes.data_ptr<int32_t>();
  p.scale = reinterpret_cast<uint16_t*>(c.scale.data_ptr());
  p.zero = reinterpret_cast<uint16_t*>(c.zero.data_ptr());
  p.status = check_finite ? c.status.data_ptr<int32_t>() : nullptr;
  p.N = N;
  p.T = T;
  p.D = D;
  p.group = G;
  p.bits = (int)bits;
  p.per_channel = per_channel;
  return c;
}

DequantizeCall prepare_dequantize(const at::Tensor& codes, const at::Tensor& scale,
                                  const at::Tensor& zero, int64_t bits, bool per_channel,
                                  at::ScalarType dtype) {
  const char* op = "dequantize";
  KVQ_CHECK_ARG(supported_bits(bits), op, "bits", "must be ", kBitsText, ", got ", bits);
  CHECK_DTYPE(op, codes, "codes", at::kInt);
  CHECK_DTYPE(op, scale, "scale", at::kHalf);
  CHECK_DTYPE(op, zero, "zero", at::kHalf);
  CHECK_MIN_DIM(op, codes, "codes", 2);
  KVQ_CHECK_ARG(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat, op, "dtype",
                "must be ", kDTypesText, ", got ", dtype);
  CHECK_SAME_DEVICE(op, codes, "codes", scale, "scale");
  CHECK_SAME_DEVICE(op, codes, "codes", zero, "zero");
  KVQ_CHECK_ARG(scale.sizes() == zero.sizes(), op, "zero", "must have the shape of 'scale' ",
                scale.sizes(), ", got ", zero.sizes());
  KVQ_CHECK_ARG(scale.dim() == codes.dim(), op, "scale", "must have the rank of 'codes'");
  const int64_t T = codes.size(-2), D = codes.size(-1) * 32 / bits;
  check_head_dim(op, "codes", D, bits);
  for (int64_t i = 0; i < codes.dim() - 2; ++i)
    KVQ_CHECK_ARG(scale.size(i) == codes.size(i), op, "scale", "leading dims ", scale.sizes(),
                  " do not match 'codes' ", codes.sizes());
  int64_t G;
  if (per_channel) {
    KVQ_CHECK_ARG(scale.size(-1) == D, op, "scale", "must have last dim D=", D, " for per-channel");
    const int64_t ng = scale.size(-2);
    KVQ_CHECK_ARG((T == 0 && ng == 0) || (ng > 0 && T % ng == 0), op, "scale",
                  "has ", ng, " groups, which does not divide T=", T);
    G = ng > 0 ? T / ng : 1;
  } else {
    KVQ_CHECK_ARG(scale.size(-2) == T, op, "scale", "must have T=", T, " rows for per-token");
    const int64_t ng = scale.size(-1);
    KVQ_CHECK_ARG(ng > 0 && D % ng == 0, op, "scale", "has ", ng, " groups per token, which does not divide D=", D);
    G = D / ng;
    KVQ_CHECK_ARG(G >= 8 && (G & (G - 1)) == 0, op, "scale", "implies group size ", G,
                  ", which is not a power of two >= 8");
  }
  DequantizeCall c;
  c.codes = contiguous_aligned(codes);
  c.scale = scale.contiguous();
  c.zero = zero.contiguous();
  auto oshape = codes.sizes().vec();
  oshape.back() = D;
  c.out = at::empty(oshape, codes.options().dtype(dtype));
  auto& p = c.params;
  p.out = c.out.data_ptr();
  p.codes = c.codes.data_ptr<int32_t>();
  p.scale = reinterpret_cast<uint16_t*>(c.scale.data_ptr());
  p.zero = reinterpret_cast<uint16_t*>(c.zero.data_ptr());
  p.N = leading_numel(c.codes, 2);
  p.T = T;
  p.D = D;
  p.group = G;
  p.bits = (int)bits;
  p.per_channel = per_channel;
  return c;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& x, int64_t bits,
                                                            int64_t group_size, bool per_channel,
                                                            bool check_finite) {
  QuantizeCall c = prepare_quantize(x, bits, group_size, per_channel, check_finite);
  const auto& p = c.params;
  const int64_t units = quant::group_quant_cpu_units(p);
  translate_errors([&] {
    KVQ_DISPATCH_DTYPE(dtype_id(c.x.scalar_type()), DType, [&] {
      at::parallel_for(0, units, parallel_grain(quant::group_quant_cpu_unit_bytes(p, sizeof(DType))),
                       [&](int64_t b, int64_t e) { quant::group_quantize_cpu<DType>(p, b, e); });
    });
  });
  if (check_finite) raise_status("quantize", "x", c.status.item<int32_t>());
  return {c.codes, c.scale, c.zero};
}

at::Tensor dequantize_cpu(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                          int64_t bits, bool per_channel, at::ScalarType dtype) {
  DequantizeCall c = prepare_dequantize(codes, scale, zero, bits, per_channel, dtype);
  const auto& p = c.params;
  translate_errors([&] {
    KVQ_DISPATCH_DTYPE(dtype_id(dtype), DType, [&] {
      at::parallel_for(0, p.N * p.T, parallel_grain(p.D * (int64_t)sizeof(DType)), [&](int64_t b, int64_t e) {
        quant::group_dequantize_cpu<DType>(p, b, e);
      });
    });
  });
  return c.out;
}

}  // namespace kvq
