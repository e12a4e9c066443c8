// Tensor-level entry points of Tandem's CPU kernels: shapes, dtypes and page tables are checked
// here (TORCH_CHECK raises a Python error), then the pointer-level kernels of kernels.h run.

#include <torch/extension.h>

#include "common.h"
#include "kernels.h"

namespace {

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), name,
              " must be a contiguous [T, H] float32 tensor");
}

// x [M, K] float32; packed [ceil(N / 16), K / 32, panel bytes] uint8 (kernels/packing.py).
torch::Tensor qmatmul(torch::Tensor x, torch::Tensor packed, int64_t n, int64_t bits, int64_t qmax) {
  check_rows(x, "x");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(qmax == 32767 || qmax == 127, "qmax must be 32767 (int16) or 127 (int8)");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % tandem::kBlock == 0, "K must be a multiple of 32, got ", k);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (n + tandem::kPanel - 1) / tandem::kPanel && packed.size(1) == k / tandem::kBlock &&
                  packed.size(2) == tandem::panel_block_bytes(static_cast<int>(bits)),
              "packed weights do not fit x [M, ", k, "] and N = ", n);
  auto out = torch::empty({m, n}, x.options());
  if (m > 0 && n > 0)
    tandem::qmatmul(x.data_ptr<float>(), m, k, packed.data_ptr<uint8_t>(), n, static_cast<int>(bits),
                    static_cast<int>(qmax), out.data_ptr<float>());
  return out;
}

// q [T, Hq, D] float32; kv_cache [P, 2, S, Hkv, D] float32 or bfloat16 (any page stride, the rest
// contiguous); the CSR page table as FlashInfer takes it (int32). Causal: query row i of a sequence
// with q_len rows and seq_len keys sits at position seq_len - q_len + i. Returns [T, Hq, D] float32.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor qo_indptr,
                              torch::Tensor kv_indptr, torch::Tensor kv_indices, torch::Tensor kv_last_page_len,
                              double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: [T, Hq, D] float32");
  TORCH_CHECK(kv_cache.dim() == 5, "kv_cache: [P, 2, S, Hkv, D]");
  TORCH_CHECK(kv_cache.stride(4) == 1 && kv_cache.stride(3) == kv_cache.size(4) &&
                  kv_cache.stride(2) == kv_cache.size(3) * kv_cache.size(4),
              "kv_cache: each page's rows contiguous");
  const bool is_bf16 = kv_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(is_bf16 || kv_cache.scalar_type() == torch::kFloat32, "kv_cache must be float32 or bfloat16");
  for (const auto& t : {qo_indptr, kv_indptr, kv_indices, kv_last_page_len})
    TORCH_CHECK(t.scalar_type() == torch::kInt32 && t.is_contiguous(), "page table tensors must be int32");
  const int64_t num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(3), page_size = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(4) == head_dim && num_q_heads % num_kv_heads == 0, "head shapes");
  TORCH_CHECK(num_q_heads / num_kv_heads <= 64, "at most 64 query heads per kv head");
  const int64_t batch = qo_indptr.size(0) - 1;
  TORCH_CHECK(batch >= 0 && kv_indptr.size(0) == batch + 1 && kv_last_page_len.size(0) == batch, "page table sizes");
  const int32_t* qo = qo_indptr.data_ptr<int32_t>();
  const int32_t* kvp = kv_indptr.data_ptr<int32_t>();
  const int32_t* last = kv_last_page_len.data_ptr<int32_t>();
  const int32_t* indices = kv_indices.data_ptr<int32_t>();
  TORCH_CHECK(qo[batch] == q.size(0), "qo_indptr[-1] must equal q's rows");
  TORCH_CHECK(kvp[0] == 0 && kvp[batch] <= kv_indices.size(0), "kv_indptr does not fit kv_indices");
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t num_pages = kvp[b + 1] - kvp[b];
    TORCH_CHECK(num_pages >= 1 && last[b] >= 1 && last[b] <= page_size, "sequence ", b, ": bad page count");
    const int64_t seq_len = (num_pages - 1) * page_size + last[b];
    TORCH_CHECK(qo[b + 1] >= qo[b] && qo[b + 1] - qo[b] <= seq_len, "sequence ", b, " has more queries than keys");
    for (int32_t i = kvp[b]; i < kvp[b + 1]; ++i)
      TORCH_CHECK(indices[i] >= 0 && indices[i] < kv_cache.size(0), "page id out of range");
  }
  auto out = torch::empty_like(q);
  const tandem::PagedKV kv{kv_cache.data_ptr(), is_bf16, kv_cache.stride(0), kv_cache.stride(1),
                           kv_cache.stride(2), kv_cache.stride(3), page_size, num_kv_heads, head_dim};
  tandem::paged_attention(q.data_ptr<float>(), num_q_heads, kv, qo, kvp, indices, last, batch,
                          static_cast<float>(scale), out.data_ptr<float>());
  return out;
}

// RMSNorm as HF Llama computes it in float32: weight * (x / sqrt(mean(x^2) + eps)), row by row.
// With `residual` (same shape): residual += x first (in place), and the sum is normalized.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, torch::optional<torch::Tensor> residual) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must be [H] float32");
  float* res = nullptr;
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must match x");
    res = residual->data_ptr<float>();
  }
  auto out = torch::empty_like(x);
  tandem::rms_norm(x.data_ptr<float>(), x.size(0), x.size(1), weight.data_ptr<float>(), static_cast<float>(eps), res,
                   out.data_ptr<float>());
  return out;
}

// silu(gate) * up for gate_up [T, 2I] = [gate | up] -> [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t width = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), width}, gate_up.options());
  tandem::silu_and_mul(gate_up.data_ptr<float>(), gate_up.size(0), width, out.data_ptr<float>());
  return out;
}

// Rotary embedding (rotate-half) applied to q [T, Hq, D] and k [T, Hkv, D] in place, from tables
// cos/sin [max_pos, D] at `positions` [T]; then k and v [T, Hkv, D] are written into the paged
// cache [P, 2, S, Hkv, D] at (write_pages[t], write_offsets[t]). All float32 but the cache, which may
// be float32 or bfloat16. q, k, v may be strided views of one fused projection (rows contiguous).
void rope_and_store(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                    torch::Tensor positions, torch::Tensor kv_cache, torch::Tensor write_pages,
                    torch::Tensor write_offsets) {
  for (const auto& t : {q, k, v})
    TORCH_CHECK(t.dim() == 3 && t.scalar_type() == torch::kFloat32 && t.stride(2) == 1 && t.stride(1) == t.size(2),
                "q, k, v must be [T, H, D] float32 with contiguous rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 &&
                  sin.scalar_type() == torch::kFloat32 && cos.size(1) == q.size(2),
              "cos/sin tables must be contiguous float32 [max_pos, D]");
  for (const auto& t : {positions, write_pages, write_offsets})
    TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.is_contiguous() && t.numel() == q.size(0),
                "positions and write slots must be int64, one per token");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.stride(4) == 1 && kv_cache.stride(3) == kv_cache.size(4) &&
                  kv_cache.size(4) == q.size(2) && kv_cache.size(3) == k.size(1),
              "cache rows must be contiguous and fit k");
  const bool is_bf16 = kv_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(is_bf16 || kv_cache.scalar_type() == torch::kFloat32, "kv_cache must be float32 or bfloat16");
  const int64_t t = q.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* pages = write_pages.data_ptr<int64_t>();
  const int64_t* offsets = write_offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0) && pages[r] >= 0 && pages[r] < kv_cache.size(0) &&
                    offsets[r] >= 0 && offsets[r] < kv_cache.size(2),
                "position or write slot out of range");
  const tandem::RopeStore args{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), q.stride(0),
                               k.stride(0), v.stride(0), q.size(1), k.size(1), q.size(2),
                               cos.data_ptr<float>(), sin.data_ptr<float>(), pos, pages, offsets,
                               kv_cache.data_ptr(), is_bf16, kv_cache.stride(0), kv_cache.stride(1),
                               kv_cache.stride(2)};
  tandem::rope_and_store(args, t);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &qmatmul,
        "x [M, K] float32 times packed block-quantized weights [N, K]^T -> [M, N]; activations rounded to "
        "int16 (qmax 32767) or int8 (qmax 127) blocks, exact integer block dots");
  m.def("paged_attention", &paged_attention, "causal attention over a paged KV cache (CSR page table)");
  m.def("rms_norm", &rms_norm, "RMSNorm of [T, H] float32 rows, optionally after adding them into a residual",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [T, 2I] float32 rows");
  m.def("rope_and_store", &rope_and_store, "rotary embedding on q, k in place; k, v written to the paged cache");
  m.def("isa", &tandem::isa_name, "the instruction set the kernels were compiled for");
}
