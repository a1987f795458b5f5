"""Peak memory of `grpo-fleet import-gguf` on a SentencePiece vocabulary bomb (pieces that extend each other) against
a vocabulary of as many ordinary pieces: each in a process of its own, its peak RSS from getrusage. The bomb is
refused in one line, at no more than twice the ordinary file's peak (it once grew with the cube of its size)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gguf_synth import k_quant_args, padded_spm_vocab, staircase_spm_vocab, tiny_model, write_model_gguf
from grpo_fleet.runtime.blas import child_env

PIECES = 800  # ~170 M characters of merges: several GB before the bound
# Runs import-gguf, then prints the process's peak RSS in MiB (ru_maxrss: KiB on Linux, bytes on macOS).
MEASURE = ("import resource, sys; from grpo_fleet.cli.main import main; code = main(['import-gguf', *sys.argv[1:]]); "
           "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
           "print(code, peak / (1 << 20 if sys.platform == 'darwin' else 1 << 10))")


def _import_peak(source: Path, out: Path) -> tuple[int, float, str]:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(source), str(out)], capture_output=True, text=True,
                          timeout=600, env=child_env())
    code, peak = done.stdout.splitlines()[-1].split()  # the last line: the CLI says what it wrote before
    return int(code), float(peak), done.stderr


def test_a_vocabulary_bomb_is_refused_within_twice_an_ordinary_files_memory(tmp_path: Path) -> None:
    files = {}
    for name, vocab in (("normal", padded_spm_vocab(PIECES)), ("bomb", staircase_spm_vocab(PIECES))):
        args = k_quant_args("gemma3", len(vocab.tokens))
        files[name] = write_model_gguf(tmp_path / f"{name}.gguf", tiny_model(args), args, vocab).path
    normal_code, normal_peak, _ = _import_peak(files["normal"], tmp_path / "normal")
    bomb_code, bomb_peak, bomb_err = _import_peak(files["bomb"], tmp_path / "bomb")
    print(f"peak RSS: ordinary vocabulary {normal_peak:.0f} MiB, bomb {bomb_peak:.0f} MiB")
    assert normal_code == 0
    assert bomb_code == 2 and len(bomb_err.strip().splitlines()) == 1 and "extend each other" in bomb_err
    assert bomb_peak <= 2 * normal_peak
