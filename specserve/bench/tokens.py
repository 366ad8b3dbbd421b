"""The tokenizer that re-counts streamed text, so stream and server usage can be compared per request.

``--tokenizer``: ``auto`` (the default model's tokenizer when the benchmarked model is the default model and
its GGUF is cached, else no re-count), ``default``, ``none``, a ``.gguf`` file, or a Hugging Face directory with
``tokenizer.json``. Re-tokenizing decoded text can legitimately differ from the generated ids (a model may emit
a non-canonical split); the report flags every such request instead of hiding it.

Reading a tokenizer out of a GGUF takes seconds, so the first read saves it as a Hugging Face tokenizer under
``<specserve cache>/tokenizers/`` (keyed by file name, size and mtime) and later runs load that.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from specserve.bench.client import TokenCounter

if TYPE_CHECKING:
    from specserve.tokenizer import Tokenizer


def resolve_token_counter(spec: str, model_name: str) -> tuple[TokenCounter | None, str]:
    """(counter or None, description); raises ValueError for a tokenizer that cannot be loaded."""
    from specserve.models.fetch import DEFAULT_MODEL_NAME, model_cache_path
    from specserve.tokenizer import Tokenizer

    if spec == "none":
        return None, "none"
    if spec == "auto":
        path = model_cache_path()
        if model_name != DEFAULT_MODEL_NAME or not path.exists():
            return None, "none (auto: not the default model, or its GGUF is not cached)"
        spec = "default"
    if spec == "default":
        path = model_cache_path()
        if not path.exists():
            raise ValueError(f"--tokenizer default: {path} not cached (run `specserve fetch-model`)")
        tokenizer = _gguf_tokenizer(path)
        desc = f"default model ({path.name})"
    else:
        path = Path(spec).expanduser()
        if path.suffix == ".gguf" and path.is_file():
            tokenizer = _gguf_tokenizer(path)
        elif (path / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_hf_dir(path)
        else:
            raise ValueError(f"--tokenizer {spec}: not a .gguf file or a directory with tokenizer.json")
        desc = str(path)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return count, desc


def _gguf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of a GGUF file, through a tokenizer.json cached beside the specserve model cache."""
    import os
    import tempfile

    from specserve.models.fetch import cache_dir
    from specserve.tokenizer import Tokenizer

    stat = path.stat()
    cached = cache_dir() / "tokenizers" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (cached / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(cached)
    tokenizer = Tokenizer.from_gguf(path)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
        tokenizer.save_hf(tmp)
        os.replace(tmp, cached)  # atomic: a concurrent run sees the whole directory or none of it
    except OSError:  # read-only cache or a concurrent writer won: the tokenizer in hand is just as good
        pass
    return tokenizer
