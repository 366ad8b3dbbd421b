"""specserve: a speculative-decoding LLM inference server with an OpenAI-compatible API."""

__version__ = "0.1.0"
