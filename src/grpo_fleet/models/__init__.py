"""Models: loading through mlx_lm, GGUF import, the zoo of wheel-shipped GGUFs, quantization, real-shape and tiny
self-built models, batched generation and held-out evaluation."""
