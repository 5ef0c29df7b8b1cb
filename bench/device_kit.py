"""Build ``.device/``: what a lent GPU host without internet needs to run ``bench/device_check.sh``.

    .venv/bin/python -m bench.device_kit          # here, once (~20 MB, needs the package index)

The GPU host has Python 3.12, CUDA torch, transformers, numpy, safetensors, httpx, xxhash and tqdm, but
not the server's web stack nor the codecs, and it reaches no package index or model hub. This writes:

* ``.device/wheels/``: manylinux x86-64 CPython 3.12 wheels of what it lacks (``DEVICE_WHEELS``, the versions
  this checkout is tested with), installed there with ``pip install --no-index --no-deps --target``;
* ``.device/cache/models/<embedded model>/``: the embedded verifier's tokenizer, chat template and config,
  without its weights: the GPU checks build their verifier with random weights on the device
  (``--model dummy:<shape>``, server/backends/dummy_model.py) and need only its tokenizer.

``.device/`` is ignored by git; the device tool carries it (``carry: [".device"]``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.core.models import ensure_embedded_model  # noqa: E402

KIT = ROOT / ".device"
# not on the GPU host's image (the device tool's package list); fastapi 0.16x would also need opentelemetry
DEVICE_WHEELS = (
    "fastapi==0.136.3",
    "starlette==1.10.0",
    "uvicorn==0.55.0",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "typing_extensions==4.16.0",
    "zstandard==0.25.0",
    "zlib-ng==1.1.0",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")  # fmt: skip
TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "chat_template.jinja", "eagle3_source.json")  # fmt: skip


def write_tokenizer(kit: Path) -> Path:
    """``kit/cache/models/<embedded model>/``: its tokenizer, chat template and config, no weights."""
    model = ensure_embedded_model()
    target = kit / "cache" / "models" / model.name
    target.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (model / name).is_file():
            shutil.copy2(model / name, target / name)
    return model


def main() -> None:
    wheels = KIT / "wheels"
    shutil.rmtree(KIT, ignore_errors=True)
    wheels.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", str(wheels)]  # fmt: skip
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run([*cmd, *DEVICE_WHEELS], check=True)  # noqa: S603 - our own pip, fixed arguments
    model = write_tokenizer(KIT)
    size_mb = sum(f.stat().st_size for f in KIT.rglob("*") if f.is_file()) / 2**20
    print(f"{KIT}: {len(list(wheels.glob('*.whl')))} wheels and the {model.name} tokenizer, {size_mb:.1f} MiB")


if __name__ == "__main__":
    main()
