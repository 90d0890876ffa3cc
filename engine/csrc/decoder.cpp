// decoder: the decoder layers of a Llama-family model (Llama, Qwen2, Mistral) for a
// decode step or a short verify block, as one call from Python.
//
// A decode step of the 1.5B target makes ~1,400 small tensor operations around its
// 113 matrix products. Issued from Python through transformers' modules they cost
// ~50 ms of a ~160 ms step on one core (the interpreter's own work, and caches cold
// after every weight stream). Here the same ATen operations run in the same order
// with the same arguments, so every value is bit-identical to the Python path
// (tests/unit/test_decoder.py checks it): only the interpreter is gone.
//
// What runs here, per layer: RMSNorm; q/k/v projections (one stacked GEMM or three);
// rotary embedding; appending K/V to the cache buffers; attention of each new row
// against the keys up to its own position (engine/attention.py's one-query form);
// output projection; residual; RMSNorm; SwiGLU MLP; residual. Embedding, rotary
// tables, final norm and LM head stay in Python.
//
// A float projection takes a block of several rows one row at a time, each row a
// fresh [1, 1, K] tensor through the very at::linear call a one-token step makes:
// MKL's GEMM reduces a row differently alone and in a block, and the verify block's
// rows must equal the steps' bit for bit (engine/invariance.py). So does silu, whose
// vectorized and scalar code round differently. forward's rows_apart says whether to;
// without, a block takes one call each (as transformers' modules do).
//
// Registered as torch.classes.specchat.Decoder; compiled on first use (engine/native.py).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <vector>

namespace {

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

// nn.Linear on x [1, M, K]: one call, or (rows_apart) one call per row as a step makes it.
at::Tensor dense(const Projection& p, const at::Tensor& x, bool rows_apart) {
  auto bias = p.bias.defined() ? c10::optional<at::Tensor>(p.bias) : c10::nullopt;
  const int64_t m = x.size(1);
  if (!rows_apart || m == 1) return at::linear(x, p.weight, bias);
  std::vector<at::Tensor> rows;
  rows.reserve(m);
  for (int64_t r = 0; r < m; ++r)
    rows.push_back(at::linear(x.narrow(1, r, 1).clone(), p.weight, bias));
  return at::cat(rows, 1);
}

// Mirrors nn.Linear, or engine/quant.py's W4A8Linear (+ SharedInputGroup's split and biases).
void project(const Projection& p, const at::Tensor& x, std::vector<at::Tensor>& out,
             bool rows_apart) {
  at::Tensor y;
  if (p.kind == kDense) {
    y = dense(p, x, rows_apart);
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

// silu on x [1, M, I]; rows_apart: one row at a time. ATen's vectorized silu rounds
// differently from its scalar tail, so an element's value depends on where it falls
// in the tensor unless each row is a tensor of its own, as in a one-token step.
at::Tensor silu(const at::Tensor& x, bool rows_apart) {
  const int64_t m = x.size(1);
  if (!rows_apart || m == 1) return at::silu(x);
  std::vector<at::Tensor> rows;
  rows.reserve(m);
  for (int64_t r = 0; r < m; ++r) rows.push_back(at::silu(x.narrow(1, r, 1).clone()));
  return at::cat(rows, 1);
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

// One query row [1, H, 1, D] against T keys [1, Hkv, T, D]: engine/attention.py's _one_query.
at::Tensor one_query(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     double scaling) {
  const int64_t h = query.size(1), d = query.size(3), h_kv = key.size(1);
  auto q = query.reshape({1, h_kv, h / h_kv, d});
  auto scores = at::matmul(q, key.transpose(-1, -2)) * scaling;
  auto probs = at::softmax(scores, -1, at::kFloat).to(value.scalar_type());
  return at::matmul(probs, value).reshape({1, 1, h, d});
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

  // Layers first..first+L-1 for M new rows at positions past..past+M-1. h [1, M, H] the
  // rows' hidden states entering layer `first`; cos, sin [1, M, D]; keys[i], values[i] the
  // cache buffers [1, Hkv, capacity, D] of layer first+i, holding `past` positions and with
  // room for M more. rows_apart: float projections and silu one row at a time. Writes
  // the new K/V and returns the last layer's output [1, M, H].
  at::Tensor forward(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys,
                     std::vector<at::Tensor> values, int64_t past, int64_t first,
                     bool rows_apart) {
    TORCH_CHECK(keys.size() == values.size() && first >= 0 &&
                    first + static_cast<int64_t>(keys.size()) <= static_cast<int64_t>(layers.size()),
                "one cache buffer per layer run");
    const int64_t m = h.size(1), end = past + m;
    cos = cos.unsqueeze(1);  // [1, 1, M, D]
    sin = sin.unsqueeze(1);
    std::vector<at::Tensor> parts;
    for (size_t i = 0; i < keys.size(); ++i) {
      const Layer& l = layers[first + i];
      TORCH_CHECK(keys[i].size(2) >= end && values[i].size(2) >= end, "cache buffer too small");
      // attention
      auto x = rms_norm(h, l.norm1, l.eps1);
      parts.clear();
      for (const auto& p : l.qkv) project(p, x, parts, rows_apart);
      auto q = parts[0].view({1, m, -1, l.head_dim}).transpose(1, 2);  // [1, H, M, D]
      auto k = parts[1].view({1, m, -1, l.head_dim}).transpose(1, 2);  // [1, Hkv, M, D]
      auto v = parts[2].view({1, m, -1, l.head_dim}).transpose(1, 2);
      q = q * cos + rotate_half(q) * sin;
      k = k * cos + rotate_half(k) * sin;
      keys[i].narrow(2, past, m).copy_(k);
      values[i].narrow(2, past, m).copy_(v);
      auto key = keys[i].narrow(2, 0, end);
      auto value = values[i].narrow(2, 0, end);
      at::Tensor att;
      if (m == 1) {
        att = one_query(q, key, value, l.scaling);
      } else {
        std::vector<at::Tensor> rows;
        for (int64_t r = 0; r < m; ++r) {  // row r sees the keys up to its own position
          const int64_t upto = end - (m - 1 - r);
          rows.push_back(one_query(q.slice(2, r, r + 1), key.narrow(2, 0, upto),
                                   value.narrow(2, 0, upto), l.scaling));
        }
        att = at::cat(rows, 1);
      }
      att = att.reshape({1, m, -1}).contiguous();
      parts.clear();
      project(l.o, att, parts, rows_apart);
      h = h + parts[0];
      // MLP
      x = rms_norm(h, l.norm2, l.eps2);
      parts.clear();
      for (const auto& p : l.gate_up) project(p, x, parts, rows_apart);
      auto act = silu(parts[0], rows_apart) * parts[1];
      parts.clear();
      project(l.down, act, parts, rows_apart);
      h = h + parts[0];
    }
    return h;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(specchat, m) {
  m.class_<Decoder>("Decoder")
      .def(torch::init<>())
      .def("add_layer", &Decoder::add_layer)
      .def("add_projection", &Decoder::add_projection)
      .def("attach_packed", &Decoder::attach_packed)
      .def("forward", &Decoder::forward);
}
