// The one TORCH_LIBRARY block: every kvq op's schema, plus the CPU implementations.
// CUDA implementations are registered in cuda_bindings.cpp (built only with CUDA).
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

static PyMethodDef kMethods[] = {{nullptr, nullptr, 0, nullptr}};

// `import kvquant_ext._C` loads this library, which registers the ops below.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, kMethods};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(kvq, m) {
  // x: [..., T, D] -> codes int32 [..., T, D*bits/32], scale/zero fp16
  //   per_channel: [..., T/G, D]; per-token: [..., T, D/G].  group_size -1 = whole axis.
  m.def("quantize(Tensor x, int bits, int group_size, bool per_channel, bool check_finite=True)"
        " -> (Tensor codes, Tensor scale, Tensor zero)");
  m.def("dequantize(Tensor codes, Tensor scale, Tensor zero, int bits, bool per_channel,"
        " ScalarType dtype) -> Tensor");
  // ---- GEAR ops (outlier_select, lowrank_power_iter, gear_compress, gear_decompress) ----
  // x: [..., T, D]; vectors = key channels (per_channel, length T) or value tokens (length D).
  //   -> values [..., V, 2k] (x.dtype; k largest then k smallest, each in index order),
  //      indices [..., V, 2k] uint8 (L <= 256) / int16 (L <= 32768) / int32.
  m.def("outlier_select(Tensor x, int k, bool per_channel) -> (Tensor values, Tensor indices)");
  // x: [..., T, d] -> A [..., T, r] (orthonormal columns), B [..., d, r]; x ~= A B^T.
  m.def("lowrank_power_iter(Tensor x, int rank, int iters, int seed) -> (Tensor A, Tensor B)");
  // GEAR: backbone codes/scale/zero (kvq.quantize format), outliers (fixed k per vector,
  // k = ceil(sparsity/2 * L)), fp16 factors A [..., T, r], B [..., D, r].  See docs/ops.md.
  m.def("gear_compress(Tensor x, int bits, int group_size, bool per_channel, float sparsity,"
        " int rank, int iters, int seed, bool check_finite=True) -> (Tensor codes, Tensor scale,"
        " Tensor zero, Tensor outlier_values, Tensor outlier_indices, Tensor A, Tensor B)");
  m.def("gear_decompress(Tensor codes, Tensor scale, Tensor zero, Tensor outlier_values,"
        " Tensor outlier_indices, Tensor A, Tensor B, int bits, bool per_channel,"
        " ScalarType dtype) -> Tensor");
  // ---- end GEAR ops ----
  // ---- HQMQ ops (hqmq_encode, hqmq_decode) ----
  // x: [..., H, T, D] (D in {32,64,128,256}), secondary fp32 [H, S, 4] ->
  //   codes int16 [..., H, T, U] (packed rows of U = hqmq_units(D, S, radius_bits) 16-bit
  //   units, the radius scale included), outliers int32 [M, 4] (Med3x records; M = 0 without
  //   a threshold).  Layout: include/kvq/hqmq/hqmq.h and docs/ops.md.
  m.def("hqmq_encode(Tensor x, Tensor secondary, int radius_bits, Tensor? outlier_threshold=None,"
        " bool check_finite=True) -> (Tensor codes, Tensor outliers)");
  m.def("hqmq_decode(Tensor codes, Tensor secondary, Tensor outliers,"
        " int radius_bits, int head_dim, ScalarType dtype) -> Tensor");
  // ---- end HQMQ ops ----
  // ---- decode attention ops ----
  // q [B, Hq, D]; per role: codes int32 [B, H, Tq, D*bits/32], scale/zero fp16 (group layout of
  // kvq.quantize), residual [B, H, Tr, D] in q's dtype; mask [B, T] (nonzero = attend).
  m.def("decode_attention_gq(Tensor q, Tensor k_codes, Tensor k_scale, Tensor k_zero, Tensor k_residual,"
        " Tensor v_codes, Tensor v_scale, Tensor v_zero, Tensor v_residual, Tensor? mask, int k_bits,"
        " bool k_per_channel, int v_bits, bool v_per_channel, float scale) -> Tensor");
  // GEAR layer: KIVI backbone of every block (keys per channel, values per token, one bit
  // width) + per role [A0, B0, ov0, oi0, off0, od0, A1, B1, ov1, oi1, off1, od1] (prefill
  // block, then the concatenated decode blocks of block_tokens each; od: the outliers'
  // corrections v - xhat, precomputed per block); layout in decode_attention.h.
  m.def("decode_attention_gear(Tensor q, Tensor k_codes, Tensor k_scale, Tensor k_zero, Tensor k_residual,"
        " Tensor v_codes, Tensor v_scale, Tensor v_zero, Tensor v_residual, Tensor? mask, int bits,"
        " Tensor[] k_gear, Tensor[] v_gear, int prefill_tokens, int block_tokens, float scale) -> Tensor");
  // HQMQ layer: per role codes int16 [B, H, T, U] (hqmq_encode's rows), secondary fp32 [H, S, 4],
  // outliers int32 [M, 4] ordered by (t / 32, b * H + h), outlier_ptr int64 CSR over that key
  // ([ceil(T/32) * B * H + 1], or empty without records); residual [B, H, Tr, D] in q's dtype:
  // the recent window, tokens T .. T + Tr - 1 in full precision.  See decode_attention_hqmq.h.
  m.def("decode_attention_hqmq(Tensor q, Tensor k_codes, Tensor k_secondary,"
        " Tensor k_outliers, Tensor k_outlier_ptr, Tensor v_codes, Tensor v_secondary,"
        " Tensor v_outliers, Tensor v_outlier_ptr, Tensor? mask, int k_radius_bits, int v_radius_bits,"
        " float scale, Tensor? k_residual=None, Tensor? v_residual=None) -> Tensor");
  // ---- end decode attention ops ----
  // ---- paged KV ops (layout: paged_decode_attention.h, docs/serving.md) ----
  // Pools [pages, H, P, ...]: full precision k_fp / v_fp [pages, H, P, D]; compressed codes int32
  // [pages, H, P, D*bits/32], scale / zero fp16 in kvq.quantize's layout of one [1, H, P, D] block.
  // paged_append: token i of k / v [N, H, D] goes to full-precision page slot // P, row slot % P;
  // then the full-precision pages compress_src are quantized into the compressed pages compress_dst.
  m.def("paged_append(Tensor(a!) k_fp, Tensor(b!) v_fp, Tensor k, Tensor v, Tensor slot_mapping,"
        " Tensor(c!)? k_codes=None, Tensor(d!)? k_scale=None, Tensor(e!)? k_zero=None, Tensor(f!)? v_codes=None,"
        " Tensor(g!)? v_scale=None, Tensor(h!)? v_zero=None, Tensor? compress_src=None,"
        " Tensor? compress_dst=None, int bits=2, bool k_per_channel=True, bool v_per_channel=False) -> ()");
  // int32 seq_lens / comp_lens [num_seqs] (device) -> int32 work list (PagedWork) of <= max_items items.
  m.def("paged_decode_plan(Tensor seq_lens, Tensor comp_lens, int max_items) -> Tensor");
  // q [num_seqs, Hq, D]; block_table int32 [num_seqs, max_pages]; -> out [num_seqs, Hq, D],
  // lse fp32 [num_seqs, Hq] (natural log of the softmax denominator of the scaled scores).
  m.def("paged_decode_attention(Tensor q, Tensor k_fp, Tensor v_fp, Tensor? k_codes, Tensor? k_scale,"
        " Tensor? k_zero, Tensor? v_codes, Tensor? v_scale, Tensor? v_zero, Tensor block_table, Tensor seq_lens,"
        " Tensor comp_lens, Tensor work, int bits, bool k_per_channel, bool v_per_channel, float scale)"
        " -> (Tensor out, Tensor lse)");
  // HQMQ pages: codes int16 [pages, H, P, U] (kvq.hqmq_encode of one [1, H, P, D] block per page),
  // secondary sets [H, S, 4] per role; no Med3x records.
  m.def("paged_decode_attention_hqmq(Tensor q, Tensor k_fp, Tensor v_fp, Tensor k_codes,"
        " Tensor k_secondary, Tensor v_codes, Tensor v_secondary, Tensor block_table,"
        " Tensor seq_lens, Tensor comp_lens, Tensor work, int radius_bits, float scale)"
        " -> (Tensor out, Tensor lse)");
  // ---- end paged KV ops ----
}

// paged_append: argument checks, the token write (CPU loop or CUDA kernel, by the pools' device) and
// kvq.quantize of the filled pages, in one function for every device.
TORCH_LIBRARY_IMPL(kvq, CompositeExplicitAutograd, m) { m.impl("paged_append", &kvq::paged_append); }

TORCH_LIBRARY_IMPL(kvq, CPU, m) {
  m.impl("quantize", &kvq::quantize_cpu);
  m.impl("dequantize", &kvq::dequantize_cpu);
  // ---- GEAR CPU impls ----
  m.impl("outlier_select", &kvq::outlier_select_cpu);
  m.impl("lowrank_power_iter", &kvq::lowrank_power_iter_cpu);
  m.impl("gear_compress", &kvq::gear_compress_cpu);
  m.impl("gear_decompress", &kvq::gear_decompress_cpu);
  // ---- end GEAR CPU impls ----
  // ---- HQMQ CPU impls ----
  m.impl("hqmq_encode", &kvq::hqmq_encode_cpu);
  m.impl("hqmq_decode", &kvq::hqmq_decode_cpu);
  // ---- end HQMQ CPU impls ----
  // ---- decode attention CPU impls ----
  m.impl("decode_attention_gq", &kvq::decode_attention_gq_cpu);
  m.impl("decode_attention_gear", &kvq::decode_attention_gear_cpu);
  m.impl("decode_attention_hqmq", &kvq::decode_attention_hqmq_cpu);
  // ---- end decode attention CPU impls ----
  m.impl("paged_decode_plan", &kvq::paged_decode_plan_cpu);
  m.impl("paged_decode_attention", &kvq::paged_decode_attention_cpu);
  m.impl("paged_decode_attention_hqmq", &kvq::paged_decode_attention_hqmq_cpu);
}
