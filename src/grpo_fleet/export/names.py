"""The GGUF types `grpo-fleet export --gguf` writes, apart from the modules that write them (the CLI lists them
without importing MLX)."""

# Written by the `gguf` package's quantizers (export/gguf_writer.py).
WRITTEN_TYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
# Written by llama.cpp's own quantizer (export/kquant.py).
K_QUANT_TYPES = ("q4_k_m",)
GGUF_TYPES = WRITTEN_TYPES + K_QUANT_TYPES
DEFAULT_GGUF = "q8_0"
