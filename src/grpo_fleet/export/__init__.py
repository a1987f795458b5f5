"""A trained run back to the apps people chat in: the fused mlx-lm directory, a GGUF for llama.cpp, Ollama and
LM Studio (export/run.py: `export_run`), and the names `ollama:` / `lmstudio:` that find those apps' own model files
(models/app_stores.py). Nothing is imported here, so the CLI can name the GGUF types without loading MLX."""
