"""GGUF (llama.cpp's format) -> an mlx-lm model directory: the header, metadata, tokenizer and weights, each read strictly."""
