"""Model execution: one model's passes and its cache (runner, decoder layers, attention,
KV cache, batch invariance, native kernels, quantization). Knows no decoding policy."""
