"""Train and measure the default model's draft heads on the GPU machine (not CI), in device calls that fit its
limits (10 minutes a call, 64 MiB carried in, 8 files of 16 MiB back):

    split   (here) cut the cached GGUF into .carry/gN parts (--part-mb; 60 fits beside the ~4 MB tree) and
            gather the prompt files and earlier samples into .carry/d. heads/ (the EAGLE-3 head, 64 MB, and the
            P-EAGLE head, 87 MB) exceeds what a call carries, so every device call runs with heads/ hidden
            (``benchmarks/device_tree.sh hide``; two ``stage`` calls); a call that starts from the EAGLE-3 head
            carries it as an xz tarball (45 MB; 64.3 MB raw + the tree is just over the 64 MiB a call carries):
            here ``mkdir -p .carry/h; tar -cf - heads/smollm2-135m-instruct-eagle3 | xz -T2 -6 > .carry/h/head.tar.xz``,
            there ``tar -xJf .carry/h/head.tar.xz`` before ``train --init-head heads/smollm2-135m-instruct-eagle3``
    stage   copy what the call carried (a GGUF part, prompt files) to /tmp/stage; one call per part, back to
            back (the machine is released after ~30 s idle, and /tmp with it)
    generate  samples only (the target's answers to every training prompt), into $OUT/<name> for ``train --data``
    train   join the GGUF parts, run ``specserve train-draft`` for EAGLE-3 (data generated with our engine,
            time-bounded, or --data .carry/d/gen*) and P-EAGLE (same data), pack the heads into $OUT
            (a later ``train --total-steps N`` call resumes the checkpoint an earlier call left in /tmp/work)
    eval    mean acceptance length with our engine, greedy, MT-Bench first turns / HumanEval / GSM8K test,
            num_spec_tokens 1..7, both heads; writes $OUT/acceptance.json
    speed   output tokens/s of the real target: plain vs the committed EAGLE-3 head vs n-gram, concurrency 1
            and whole sets; writes $OUT/speed.json

Both heads embed with the target's table, which is not part of a head (P-EAGLE keeps only its learned mask-token
row, ``mask_embedding``), so a head comes back and is committed as trained.

Training processes side by side: each EAGLE-3 process with the 32,768-token draft vocabulary needs more than 43 GiB
at 10k-token batches (stop 18: three processes capped at 0.31 of the GPU each all ran out of memory); two processes,
EAGLE-3 at ``--memory-fraction 0.55`` and P-EAGLE at ``0.42``, with 8k-token batches ran.

Before committing heads, ``python tools/submission_size.py``: a stop's commits are rejected whole past 256 MiB of
diffs, and replacing a 64 MB head counts its old and new bytes; commit each head once, at the end.

    benchmarks/device_tree.sh hide; python benchmarks/train_heads_gpu.py split   (here, once)
    python benchmarks/train_heads_gpu.py stage|train|eval|pack|send   (device calls, carrying .carry/gK or .carry/d)
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import statistics
import sys
import tarfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STAGE = Path("/tmp/stage")
WORK = Path("/tmp/work")
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TRAIN_SOURCES = ["gpteacher", "gsm8k/train.jsonl.gz", "sharegpt", "t0", "wmt_ende_opennmt", "tasks"]
TASK_PROMPTS = 6000  # conversations of train/task_prompts.py that split writes to data/tasks/
OUT = Path(os.environ.get("OUT", "/tmp/out"))
# the staged evaluation sets: eval measures on them, and generate --self-prompts keeps their n-grams out
EVAL_FILES = [STAGE / "data/mt_bench/question.jsonl.gz", STAGE / "data/HumanEval.jsonl.gz",
              STAGE / "data/gsm8k/test.jsonl.gz"]


# T0 templates trained on: datasets whose licences allow it (SOURCE.md); SAMSum, XSum, Gigaword and Multi-News not
T0_TRAINED = ("adversarial_qa", "cnn_dailymail", "duorc", "quoref", "ropes")


def split(part_mb: float, data_dir: Path) -> None:
    """Here, before the GPU calls: the cached GGUF into ``.carry/g1 .. gN/gguf.partNN`` of at most ``part_mb``
    MB each, and the prompt files gzipped into ``.carry/d/data`` in the layout ``TRAIN_SOURCES`` and
    ``eval_prompts`` read (``data_dir``: the project's shared/data; T0 only the ``T0_TRAINED`` templates), and
    ``TASK_PROMPTS`` task prompts (``train/task_prompts.py``: our templates around those sources' passages).
    With heads/ hidden (``benchmarks/device_tree.sh hide``) the tree is ~4 MB: one ``stage`` call per part,
    the last carrying ``.carry/d`` too (the warm machine keeps /tmp/stage between calls)."""
    from specserve.models.fetch import default_model_path
    from specserve.train import task_prompts

    raw = default_model_path().read_bytes()
    part = int(part_mb * 1e6)
    for old in ROOT.glob(".carry/g*"):
        shutil.rmtree(old)
    for i in range(0, len(raw), part):
        d = ROOT / f".carry/g{i // part + 1}"
        d.mkdir(parents=True)
        (d / f"gguf.part{i // part:02d}").write_bytes(raw[i:i + part])
    dst = ROOT / ".carry/d/data"
    shutil.rmtree(dst, ignore_errors=True)
    files = {f"gpteacher/{f.name}": f for f in (data_dir / "gpteacher").glob("*.json")}
    files |= {f"sharegpt/{f.name}": f for f in (data_dir / "sharegpt").glob("*.json*")}
    files |= {f"wmt_ende_opennmt/{f.name}": f for f in (data_dir / "wmt_ende_opennmt").glob("*.txt")}
    files |= {f"t0/{f.name}": f for f in (data_dir / "t0_sum_qa").glob("*.jsonl") if f.name.startswith(T0_TRAINED)}
    files |= {"gsm8k/train.jsonl": data_dir / "gsm8k/train.jsonl", "gsm8k/test.jsonl": data_dir / "gsm8k/test.jsonl",
              "mt_bench/question.jsonl": data_dir / "mt_bench/question.jsonl"}  # the last two: evaluation only
    for name, src in files.items():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        with open(src, "rb") as f, gzip.open(dst / f"{name}.gz", "wb") as g:
            shutil.copyfileobj(f, g)
    shutil.copy(data_dir / "humaneval/HumanEval.jsonl.gz", dst / "HumanEval.jsonl.gz")
    task_prompts.write(task_prompts.build(data_dir, TASK_PROMPTS), dst / "tasks/task_prompts.jsonl.gz")
    print("parts", sorted(p.name for p in ROOT.glob(".carry/g*")), "data files", len(files) + 1)


def stage() -> None:
    """Copy whatever this call carried into /tmp/stage: GGUF parts (``.carry/g*``, or the older ``.carry/a/p1``)
    and the prompt files (``.carry/d/data`` or ``.carry/a/data``)."""
    STAGE.mkdir(parents=True, exist_ok=True)
    for part in sorted(ROOT.glob(".carry/g*/gguf.part*")):
        shutil.copy(part, STAGE / part.name)
    if (ROOT / ".carry/a/p1").exists():
        shutil.copy(ROOT / ".carry/a/p1", STAGE / "gguf.part00")
    for data in (ROOT / ".carry/d/data", ROOT / ".carry/a/data"):
        if data.exists():
            shutil.copytree(data, STAGE / "data", dirs_exist_ok=True)
    print("staged", sorted(p.name for p in STAGE.iterdir()))


def join_gguf() -> Path:
    path = STAGE / "model.gguf"
    if not path.exists():
        if not (STAGE / "data").exists():
            stage()  # this call carried the data (``.carry/d``)
        parts = sorted(STAGE.glob("gguf.part*"))
        if (ROOT / ".carry/b/p2").exists():  # the older two-part layout
            parts.append(ROOT / ".carry/b/p2")
        with open(path, "wb") as f:
            for part in parts:
                f.write(part.read_bytes())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != GGUF_SHA256:
        path.unlink()
        raise SystemExit(f"joined GGUF sha256 {digest} != {GGUF_SHA256}")
    return path


def train(args) -> None:
    from specserve.config import TrainDraftConfig
    from specserve.train.pipeline import train_draft

    if args.name and not (args.eagle3_only or args.peagle_only):
        raise SystemExit("--name: one head per name; add --eagle3-only or --peagle-only")
    if args.memory_fraction:  # several training processes share the GPU: none may take the others' memory
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
    gguf = join_gguf()
    data = STAGE / "data"
    prompts = [str(data / s) for s in TRAIN_SOURCES]
    common = dict(draft_vocab_size=args.draft_vocab, max_new_tokens=args.max_new_tokens, max_seq_len=1024,
                  max_batch_tokens=args.batch_tokens, epochs=100.0, lr=args.lr, warmup_steps=30,
                  dataset_answers=args.dataset_answers, eval_every=args.eval_every, weight_decay=args.weight_decay,
                  hard_label_weight=args.hard_label_weight)
    reports = {}
    eagle = TrainDraftConfig(method="eagle3", num_layers=1, ttt_steps=7, max_generate_seconds=args.gen_seconds,
                             max_train_seconds=args.train_seconds, total_steps=args.total_steps,
                             head_intermediate_size=args.head_intermediate,
                             init_head=str(ROOT / args.init_head) if args.init_head else None, **common)
    name = args.name or "eagle3"
    data_dir = [str(ROOT / d) for d in args.data] if args.data else None  # samples generated by earlier calls
    extra = [str(ROOT / d) for d in args.extra_data]  # earlier sessions' samples, added to the training split
    if not args.peagle_only:
        reports[name] = train_draft(str(gguf), eagle, prompts, WORK / name, "cuda", data_dir,
                                        args.per_file, 1024 + args.max_new_tokens, args.max_num_seqs, 24.0,
                                        extra_data=extra)
        if not args.no_pack:
            pack(reports)  # what is done comes back even if the P-EAGLE run does not finish
    if args.eagle3_only:
        return
    name = args.name or "peagle"
    peagle = TrainDraftConfig(method="peagle", num_layers=args.peagle_layers, num_spec_tokens=7,
                              max_train_seconds=args.peagle_train_seconds or args.train_seconds,
                              anchors_per_seq=256, anchor_chunk=128, total_steps=args.peagle_total_steps,
                              peagle_chain_weight=args.peagle_chain_weight,
                              head_intermediate_size=args.head_intermediate,
                              init_head=str(ROOT / args.peagle_init_head) if args.peagle_init_head else None,
                              **common)
    reports[name] = train_draft(str(gguf), peagle, prompts if args.dataset_answers else [], WORK / name,
                                "cuda", data_dir or str(WORK / "eagle3"), args.per_file, extra_data=extra)
    if not args.no_pack:
        pack(reports)


def generate(args) -> None:
    """Samples only, no training: the target answers the training prompts (``--sources``, default every
    training source; ``--max-turns`` user turns each, ``--answers-per-conversation`` answers or
    ``--answers-per-source``'s, the first greedy for 75%), for at most ``--gen-seconds``. ``--shards N``: N
    processes share the GPU, each answering every N-th conversation (one process keeps the GPU idle between
    its turns' batches). The samples go to /tmp/work/<name>/ (``data_train.npz`` / ``data_held_out.npz``, for
    ``train --data``) and come back as $OUT/<name>-<j>/ parts of at most 15 MB (each such a directory), with
    the generation stats in $OUT/<name>_stats.json.

    ``--held-out-from DIR``: the conversations of that earlier run's held-out split are not answered, and this
    run's held-out files are left empty, so that ``train --data DIR --extra-data <this run>`` trains on both
    and still measures on DIR's held-out conversations alone (``--extra-data`` trains on held-out files too)."""
    import subprocess

    from specserve.train.generate import load_samples, save_samples

    name = args.name or "gen"
    if args.shard is not None:
        return _generate_shard(args, f"{name}.shard{args.shard}")
    unknown = [s for s in args.sources
               if not any(os.path.normpath(s) == t or os.path.normpath(s).startswith(t + "/") for t in TRAIN_SOURCES)]
    if unknown:
        raise SystemExit(f"--sources: {unknown} are not training sources (under {TRAIN_SOURCES})")
    if args.shards < 1:
        raise SystemExit("--shards: must be >= 1")
    join_gguf()  # once, before any shard reads it
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 4) // args.shards))}
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--shard", str(i)], env=env)
             for i in range(args.shards)]
    codes = [proc.wait() for proc in procs]  # every shard ends before anything is read or raised
    if any(codes):
        raise SystemExit(f"generate shards failed: exit codes {codes}")
    shards = [WORK / f"{name}.shard{i}" for i in range(args.shards)]
    train = [s for d in shards for s in load_samples(d / "data_train.npz")]
    held = [] if args.held_out_from else load_samples(shards[0] / "data_held_out.npz")
    per_shard = [json.loads((d / "generate_stats.json").read_text()) for d in shards]
    stats = {"command": " ".join(["python", *sys.argv]), "shards": per_shard, "train_samples": len(train),
             "held_out_samples": len(held),
             "generated_tokens": sum(st["train"]["generated_tokens"] for st in per_shard),
             "self_prompts_kept": sum(st.get("self_prompts", {}).get("kept", 0) for st in per_shard),
             "self_prompt_seconds": max(st.get("self_prompts", {}).get("seconds", 0.0) for st in per_shard),
             "seconds": max(st["train"]["seconds"] for st in per_shard)}
    (WORK / name).mkdir(parents=True, exist_ok=True)
    save_samples(train, WORK / name / "data_train.npz")
    save_samples(held, WORK / name / "data_held_out.npz")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}_stats.json").write_text(json.dumps(stats, indent=2))
    tokens = sum(len(s.token_ids) for s in train)
    parts = max(1, -(-tokens * 2 // (15 << 20)))  # ~1.4 compressed bytes a token: 2 leaves room
    for j in range(parts):
        d = OUT / f"{name}-{j}"
        d.mkdir(parents=True, exist_ok=True)
        save_samples(train[j::parts], d / "data_train.npz")
        save_samples(held if j == 0 else [], d / "data_held_out.npz")
    print(f"generated {len(train)} train / {len(held)} held-out samples, {stats['generated_tokens']} tokens "
          f"({args.shards} shards), {parts} parts in $OUT", flush=True)


def _generate_shard(args, name: str) -> None:
    from specserve.config import TrainDraftConfig
    from specserve.models.loader import load_model
    from specserve.train.data import expand_paths
    from specserve.train.generate import load_samples, save_samples
    from specserve.train.pipeline import generate_data

    device = torch.device(args.device)
    cfg = TrainDraftConfig(max_new_tokens=args.max_new_tokens, max_turns=args.max_turns,
                           answers_per_conversation=args.answers_per_conversation,
                           answers_per_source=args.answers_per_source, max_generate_seconds=args.gen_seconds,
                           self_prompts=args.self_prompts, self_prompt_temperature=args.self_prompt_temperature,
                           self_prompt_top_p=args.self_prompt_top_p)
    max_len = 1024 + args.max_new_tokens
    parts = load_model(str(STAGE / "model.gguf"), "bfloat16" if device.type == "cuda" else "float32", device,
                       max_len)
    earlier = load_samples(ROOT / args.held_out_from / "data_held_out.npz") if args.held_out_from else None
    train, held, stats = generate_data(parts, cfg, expand_paths([str(STAGE / "data" / s) for s in args.sources]),
                                       device, args.per_file, max_len, args.max_num_seqs, args.kv_gib / args.shards,
                                       progress=args.shard == 0, shard=(args.shard, args.shards),
                                       held_out_from=earlier, decontaminate=EVAL_FILES if args.self_prompts else None)
    (WORK / name).mkdir(parents=True, exist_ok=True)
    save_samples(train, WORK / name / "data_train.npz")
    save_samples(held, WORK / name / "data_held_out.npz")
    (WORK / name / "generate_stats.json").write_text(json.dumps(stats, indent=2))
    print(f"{name}: {len(train)} train / {len(held)} held-out samples, {stats['train']['generated_tokens']} "
          f"tokens in {stats['train']['seconds']:.0f} s", flush=True)


def pack(reports: dict, parts: str | None = None) -> None:
    """The heads trained under /tmp/work/<name> + reports
    -> /tmp/work/bundle-<names>.tar -> $OUT/<names>.tar.NN, 15 MB parts. At most 64 MiB comes back from one call: a
    bundle larger than that (a P-EAGLE head of 2-4 wide layers is 87-133 MB) comes back over several calls,
    ``parts`` "A:B" writing parts A..B-1 now and ``send_parts`` the rest in the next calls (the warm machine
    keeps /tmp/work). Both heads together (EAGLE-3 64 MB + a 2-layer P-EAGLE 4x wide, 87 MB) make a 151 MB bundle of
    10 parts, four a call (64 MiB comes back at most): ``pack --pack-parts 0:4``, ``send --pack-parts 4:8``, ``send
    --pack-parts 8:10``; here ``cat`` the parts in order and untar (checked on CPU with a SmolLM2-shaped head)."""
    OUT.mkdir(parents=True, exist_ok=True)
    stem = "-".join(reports)
    bundle = WORK / f"bundle-{stem}"  # per stem: two training processes may pack side by side
    shutil.rmtree(bundle, ignore_errors=True)
    for method in reports:
        dst = bundle / method
        dst.mkdir(parents=True)
        src = WORK / method
        for f in src.iterdir():
            if f.name.endswith((".safetensors", ".json")):
                shutil.copy(f, dst / f.name)
        (dst / "train_report.json").write_text(json.dumps(reports.get(method, {}), indent=2, default=str))
    with tarfile.open(WORK / f"bundle-{stem}.tar", "w") as tar:
        tar.add(bundle, arcname="heads")
    send_parts(stem, parts)
    for method in reports:
        r = reports[method]
        summary = {k: r.get(k) for k in ("num_train_samples", "train_answer_tokens", "draft_vocab_coverage",
                                         "held_out", "seconds", "data")}
        (OUT / f"{method}_summary.json").write_text(json.dumps(summary, indent=2, default=str))


def send_parts(stem: str, parts: str | None = None) -> None:
    """Parts ``A:B`` (all when None) of /tmp/work/bundle-<stem>.tar -> $OUT/<stem>.tar.NN (15 MB each); here,
    ``cat <stem>.tar.* > bundle.tar`` joins the parts of every call."""
    raw = (WORK / f"bundle-{stem}.tar").read_bytes()
    size = 15 << 20
    count = -(-len(raw) // size)
    first, last = (int(x) for x in parts.split(":")) if parts else (0, count)
    OUT.mkdir(parents=True, exist_ok=True)
    for i in range(first, min(last, count)):
        (OUT / f"{stem}.tar.{i:02d}").write_bytes(raw[i * size:(i + 1) * size])
    print(f"bundle {len(raw) / 1e6:.1f} MB in {count} parts; sent {first}..{min(last, count) - 1}")


def eval_prompts(data: Path, gsm8k_limit: int) -> dict[str, list[list[dict]]]:
    def lines(path: Path):
        with gzip.open(path, "rt") as f:
            return [json.loads(line) for line in f if line.strip()]
    mt = [[{"role": "user", "content": r["turns"][0]}] for r in lines(data / "mt_bench/question.jsonl.gz")]
    he = [[{"role": "user", "content": "Complete the following Python function.\n\n" + r["prompt"]}]
          for r in lines(data / "HumanEval.jsonl.gz")]
    gsm = [[{"role": "user", "content": r["question"]}] for r in lines(data / "gsm8k/test.jsonl.gz")][:gsm8k_limit]
    return {"mt_bench": mt, "humaneval": he, "gsm8k": gsm}


def eval_engine(args, heads: dict[str, Path], extra: dict | None = None):
    """(engine, prompt ids per evaluation set): the real target (bf16, CUDA graphs) from the staged GGUF with the
    EAGLE heads of ``heads`` (method -> directory; a directory without config.json is skipped) and the ``extra``
    proposers (name -> proposer) loaded, and the chat-templated MT-Bench / HumanEval / GSM8K prompts."""
    from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from specserve.engine.engine import LLMEngine
    from specserve.models.loader import load_model
    from specserve.spec.eagle3 import load_eagle_proposer

    gguf = join_gguf()
    device = torch.device(args.device)
    model, config, tok = load_model(str(gguf), "bfloat16" if device.type == "cuda" else "float32", device, 2048)
    engine_cfg = EngineConfig(device=args.device, cache=CacheConfig(kv_cache_memory_gib=40.0 if device.type == "cuda"
                                                                    else 1.0),
                              scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=16384,
                                                        max_model_len=2048))
    probe = LLMEngine(engine_cfg, model, config, tok, proposers={})
    proposers = {m: load_eagle_proposer(m, str(d), model, config, probe.runner.num_blocks, 16, device)
                 for m, d in heads.items() if (d / "config.json").exists()} | (extra or {})
    del probe
    torch.cuda.empty_cache()
    engine = LLMEngine(engine_cfg, model, config, tok, proposers=proposers)
    sets = eval_prompts(STAGE / "data", args.gsm8k_limit)
    return engine, {name: [tok.encode(tok.apply_chat_template(m)) for m in msgs] for name, msgs in sets.items()}


def evaluate(args) -> None:
    from specserve.sampling import SamplingParams
    from specserve.spec.params import SpecParams

    candidates = args.eagle3_dir
    engine, ids = eval_engine(args, {"eagle3": WORK / candidates[0], "peagle": WORK / args.peagle_dir})
    with gzip.open(STAGE / "data/mt_bench/question.jsonl.gz", "rt") as f:
        categories = [json.loads(line)["category"] for line in f if line.strip()]  # eval_prompts' order
    proposers = engine.proposers
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    results: dict = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(0),
                     "num_prompts": {k: len(v) for k, v in ids.items()}, "max_tokens": args.max_tokens,
                     "greedy": True, "results": {}}
    flat = [(name, p) for name, ps in ids.items() for p in ps]

    def measure(method: str, k: int, temperature: float = 0.0) -> dict:
        run = params if not temperature else SamplingParams(max_tokens=args.max_tokens, temperature=temperature,
                                                            seed=0)
        reqs = engine.generate([p for _, p in flat], run, SpecParams(method, k))
        per = {}
        for name in ids:
            rs = [r for (n, _), r in zip(flat, reqs) if n == name]
            per[name] = _acceptance(rs, k)
            if name == "mt_bench":  # where MT-Bench lags: writing, roleplay, ... (10 first turns each)
                per[name]["by_category"] = {c: _acceptance([r for r, rc in zip(rs, categories) if rc == c], k)[
                    "mean_acceptance_length"] for c in dict.fromkeys(categories)}
        return per

    start = time.perf_counter()
    if len(candidates) > 1 and "eagle3" in proposers:
        # several EAGLE-3 heads under /tmp/work: each measured at k = 5, the best on MT-Bench keeps the full table
        measured = {}
        for cand in candidates:
            if cand != candidates[0]:
                _use_eagle3(engine, WORK / cand)
            measured[cand] = measure("eagle3", 5)
            print(f"candidate {cand} k=5: " + ", ".join(f"{n} AL {v['mean_acceptance_length']:.3f}"
                                                          for n, v in measured[cand].items()), flush=True)
            if args.sampled_temperature:  # what a head's labels do to sampled (rejection-sampling) verification
                sampled = measure("eagle3", 5, args.sampled_temperature)
                results.setdefault("candidates_k5_sampled", {})[cand] = sampled
                print(f"candidate {cand} k=5 T={args.sampled_temperature}: " + ", ".join(
                    f"{n} AL {v['mean_acceptance_length']:.3f}" for n, v in sampled.items()), flush=True)
        best = max(candidates, key=lambda c: measured[c]["mt_bench"]["mean_acceptance_length"])
        results["candidates_k5"] = measured
        results["eagle3_dir"] = best
        if best != candidates[-1]:
            _use_eagle3(engine, WORK / best)
        results["results"]["eagle3"] = {"5": measured[best]}
    order = [("eagle3", 5), ("peagle", 7), ("eagle3", 7)] + [(m, k) for k in (3, 1, 2, 4, 6) for m in
                                                             ("eagle3", "peagle")] + [("peagle", 5)]
    order = [(m, k) for m, k in order if m in proposers and str(k) not in results["results"].get(m, {})]
    for method, k in order:
        if time.perf_counter() - start > args.budget:
            results.setdefault("skipped", []).append([method, k])
            continue
        t0 = time.perf_counter()
        per = measure(method, k)
        results["results"].setdefault(method, {})[str(k)] = per
        print(f"{method} k={k}: " + ", ".join(f"{n} AL {v['mean_acceptance_length']:.2f}" for n, v in per.items())
              + f" ({time.perf_counter() - t0:.0f}s)", flush=True)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "acceptance.json").write_text(json.dumps(results, indent=2))


def _use_eagle3(engine, head_dir: Path) -> None:
    """Swap the engine's EAGLE-3 proposer for the head in ``head_dir`` (no request in flight), its draft graphs
    captured afresh into the target graphs' pool."""
    from specserve.spec.eagle3 import load_eagle_proposer

    del engine.proposers["eagle3"]
    torch.cuda.empty_cache()
    engine.proposers["eagle3"] = load_eagle_proposer("eagle3", str(head_dir), engine.runner.model,
                                                     engine.model_config, engine.runner.num_blocks,
                                                     engine.config.cache.block_size, engine.device)
    engine._setup_draft_graphs(engine.config, engine.runner.model)


def _acceptance(reqs, k: int) -> dict:
    drafts = sum(r.spec_counters.num_drafts for r in reqs)
    acc = sum(r.spec_counters.num_accepted_tokens for r in reqs)
    return {"mean_acceptance_length": 1 + acc / max(drafts, 1), "num_drafts": drafts, "accepted_tokens": acc,
            "output_tokens": sum(len(r.output_ids) for r in reqs), "acceptance_rate": acc / max(drafts * k, 1)}


def speed(args) -> None:
    """What the shipped head buys on the GPU: output tokens/s of the real target (bf16, CUDA graphs, our engine)
    with no speculation, EAGLE-3 (``--eagle3-head``, the committed head by default) at k = 3 and 5, and n-gram
    at k = 3, the last two also with adaptive speculation (a fresh policy per row, its learning timed too),
    greedy, on the three evaluation sets; at concurrency 1 (the first ``--c1-prompts`` prompts of each
    set one after another), at concurrency 8 (the first ``--c8-prompts`` prompts, eight at a time) and with the
    whole set submitted at once (run twice, the second timed: the first captures the draft graphs of the batch
    buckets it passes through, as a warm server has, and an adaptive row's policy learns; the first run's time is
    kept as ``first_run_seconds``). Greedy speculation is lossless up to the rounding of bf16 GEMMs over other row
    counts, so the outputs are compared with plain decoding's and the share that is identical token for token is
    recorded. With ``--sampled-temperature T`` also plain and EAGLE-3 (k = 3, 5) sampling at temperature T (seed 0
    for every request, so the plain and speculative rows draw from the same distributions; outputs differ, as
    rejection sampling draws other random numbers): the acceptance length a sampled request gets, and its speed.
    With ``--repeats N`` every row runs N times, the rows of a set and mode interleaved (drift reaches each alike),
    and reports the median (an adaptive row's policy learns afresh each time, so its runs spread the widest).
    Writes $OUT/speed.json."""
    from benchmarks.gpu_engine import sync
    from specserve.config import SpecConfig
    from specserve.sampling import SamplingParams
    from specserve.spec.ngram import NgramProposer
    from specserve.spec.params import SpecParams
    from specserve.spec.policy import SpecPolicy

    class Counting(SpecPolicy):
        """Counts its decisions per arm and bucket ({"1-1": {"none": 2900, "0": 40, ...}}; both runs of a whole
        set), to see where an adaptive row spent its steps."""

        def __init__(self, **kw) -> None:
            super().__init__(**kw)
            self.choices: dict[str, dict[str, int]] = {}

        def choose(self, batch_size: int) -> int | None:
            cap = super().choose(batch_size)
            b = self.bucket(batch_size)
            arms = self.choices.setdefault(f"{1 << b}-{(2 << b) - 1}", {})
            arms["none" if cap is None else str(cap)] = arms.get("none" if cap is None else str(cap), 0) + 1
            return cap

    engine, ids = eval_engine(args, {"eagle3": ROOT / args.eagle3_head},
                              {"ngram": NgramProposer(SpecConfig.ngram_min, SpecConfig.ngram_max)})
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    sampled = SamplingParams(max_tokens=args.max_tokens, temperature=args.sampled_temperature or 1.0, seed=0)
    # (method, k, adaptive, temperature): adaptive rows run with a fresh SpecPolicy (spec/policy.py), its learning
    # included; a temperature > 0 row samples (its baseline: the plain row at that temperature)
    methods = [("none", 0, False, 0.0), ("eagle3", 3, False, 0.0), ("eagle3", 5, False, 0.0),
               ("ngram", 3, False, 0.0), ("eagle3", 3, True, 0.0), ("ngram", 3, True, 0.0)]
    if args.sampled_temperature:
        methods += [(m, k, False, args.sampled_temperature) for m, k in (("none", 0), ("eagle3", 3), ("eagle3", 5))]
    # Warm-up: graph captures and kernel compiles stay out of the timings. Every draft length up to each row's k (an
    # adaptive row's caps, and fewer drafts near max_tokens), at batch 1 and at batch 8 (which drains through the
    # smaller buckets), and each set's first prompts one at a time (prefill kernels compile per shape class): stop
    # 27's step_trace_gpu.py found 0.4 s steps on first use of a shape inside timed rows.
    # An adaptive row also runs once with a policy (its catch-ups after cap-0 steps ingest longer queues).
    for method, k, adaptive, temperature in methods:
        for num_spec in range(1, k + 1) if k else (0,):
            for batch in (ids["mt_bench"][:1], ids["mt_bench"][:8]):
                engine.generate(batch, SamplingParams(max_tokens=24, temperature=temperature, seed=0),
                                SpecParams(method, num_spec))
        if adaptive:
            for batch in (ids["humaneval"][:1], ids["humaneval"][:8]):
                engine.set_spec_policy(SpecPolicy(caps=(0, 1, max(1, k // 2)), probe_every=4))
                engine.generate(batch, SamplingParams(max_tokens=96, temperature=temperature, seed=0),
                                SpecParams(method, k))
            engine.set_spec_policy(None)
    for prompts in ids.values():
        for prompt in prompts[:2]:
            engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))
    chain = getattr(engine.proposers.get("eagle3"), "chain", None)  # the drafter's graphs of every queue length
    if chain is not None:  # (an adaptive row's catch-ups after cap-0 steps queue up to 16 entries)
        chain.build(list(range(1, 9)), list(range(0, 5)))
    results: dict = {"command": " ".join(sys.argv), "head": args.eagle3_head,
                     "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
                     "max_tokens": args.max_tokens, "greedy": not args.sampled_temperature,
                     "sampled_temperature": args.sampled_temperature, "c1_prompts": args.c1_prompts,
                     "c8_prompts": args.c8_prompts, "num_prompts": {k: len(v) for k, v in ids.items()}, "rows": []}
    plain: dict = {}  # (set, mode, temperature) -> plain decoding's (outputs, tokens/s), that row group's baseline
    for name, prompts in ids.items():
        for mode, batch, group in (("c1", prompts[:args.c1_prompts], 1), ("c8", prompts[:args.c8_prompts], 8),
                                   ("all", prompts, len(prompts))):
            if mode not in args.modes.split(","):
                continue
            measured: dict = {}  # row -> [(run times, requests, policy)] of each repeat, rows interleaved
            for _ in range(args.repeats):
                for row_key in methods:
                    method, k, adaptive, temperature = row_key
                    spec, params = SpecParams(method, k), sampled if temperature else greedy
                    engine.set_spec_policy(Counting(caps=(0, 1, max(1, k // 2))) if adaptive else None)
                    runs = []  # "all" runs twice: the first captures the draft graphs of its batch buckets (and an
                    for _ in range(2 if mode == "all" else 1):  # adaptive row's policy learns); the second is timed
                        sync(engine.device)
                        t0 = time.perf_counter()
                        reqs = [r for i in range(0, len(batch), group)
                                for r in engine.generate(batch[i:i + group], params, spec)]
                        sync(engine.device)
                        runs.append(time.perf_counter() - t0)
                    measured.setdefault(row_key, []).append((runs, reqs, engine.spec_policy))
            for method, k, adaptive, temperature in methods:
                reps = measured[(method, k, adaptive, temperature)]
                tok_s_runs = [sum(len(r.output_ids) for r in reqs) / runs[-1] for runs, reqs, _ in reps]
                runs, reqs, policy = reps[-1]
                outs = [list(r.output_ids) for r in reqs]
                tokens = sum(map(len, outs))
                tok_s = statistics.median(tok_s_runs)
                if method == "none":
                    plain[(name, mode, temperature)] = (outs, tok_s, tok_s_runs)
                plain_outs, plain_tok_s, plain_runs = plain[(name, mode, temperature)]
                drafts = sum(r.spec_counters.num_drafts for r in reqs)
                acc = sum(r.spec_counters.num_accepted_tokens for r in reqs)
                row = {"set": name, "mode": mode, "num_prompts": len(batch), "method": method, "k": k,
                       "adaptive": adaptive, "temperature": temperature,
                       "first_run_seconds": runs[0] if len(runs) > 1 else None,
                       "policy": policy.snapshot() if policy is not None else None,
                       "policy_choices": policy.choices if policy is not None else None,
                       "output_tokens": tokens, "seconds": runs[-1], "tok_s": tok_s, "tok_s_runs": tok_s_runs,
                       "mean_acceptance_length": 1 + acc / drafts if drafts else None,
                       "identical_to_plain": sum(a == b for a, b in zip(outs, plain_outs)) / max(len(outs), 1),
                       "speedup_vs_plain": tok_s / plain_tok_s,
                       "speedup_vs_plain_runs": [t / p for t, p in zip(tok_s_runs, plain_runs)]}
                results["rows"].append(row)
                spread = f" ({min(tok_s_runs):.0f}-{max(tok_s_runs):.0f})" if len(tok_s_runs) > 1 else ""
                print(f"{name:9s} {mode:3s} T={temperature:.1f} {method:6s} k={k}{'a' if adaptive else ' '}: "
                      f"{row['tok_s']:8.0f} tok/s{spread} "
                      f"x{row['speedup_vs_plain']:.2f} AL {row['mean_acceptance_length'] or 1:.2f} "
                      f"same {row['identical_to_plain']:.2f}", flush=True)
                OUT.mkdir(parents=True, exist_ok=True)
                (OUT / "speed.json").write_text(json.dumps(results, indent=2))


def main() -> int:
    # a 32k-row draft LM head's [rows, vocab] fp32 temporaries fragment the caching allocator (stop 16 ran out of
    # memory with 9.7 GiB reserved but free); read when CUDA first allocates, so set before any work
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["split", "stage", "generate", "train", "eval", "speed", "pack",
                                           "send"])
    ap.add_argument("--part-mb", type=float, default=49.5, help="split: GGUF part size")
    ap.add_argument("--data-dir", type=Path,
                    default=Path(os.environ.get("SPECSERVE_DATA_DIR", ROOT.parent / "shared/data")),
                    help="split: the shared prompt files (default: $SPECSERVE_DATA_DIR or ../shared/data)")
    ap.add_argument("--gen-seconds", type=float, default=210)
    ap.add_argument("--train-seconds", type=float, default=110)
    ap.add_argument("--peagle-train-seconds", type=float, default=0)
    ap.add_argument("--total-steps", type=int, default=0,
                    help="EAGLE-3: a fixed LR schedule of this many steps; a call stops at --train-seconds and the "
                         "next call on the same warm machine (/tmp/work/eagle3/checkpoint.pt) resumes it")
    ap.add_argument("--peagle-total-steps", type=int, default=0, help="the same for P-EAGLE")
    ap.add_argument("--eagle3-only", action="store_true")
    ap.add_argument("--name", default=None, help="train into /tmp/work/NAME (default: the method's name), so that "
                    "several processes can train variants side by side on one GPU")
    ap.add_argument("--head-intermediate", type=int, default=0,
                    help="head MLP width, both methods (0: the target's)")
    ap.add_argument("--init-head", default=None, help="EAGLE-3: start from this trained head (a path in the repo, "
                    "e.g. heads/smollm2-135m-instruct-eagle3, which travels with the tree; --draft-vocab and "
                    "--head-intermediate must match it)")
    ap.add_argument("--no-pack", action="store_true", help="leave the heads on the machine (a later call packs)")
    ap.add_argument("--pack", nargs="+", default=None, help="pack (send: the parts of) these /tmp/work names")
    ap.add_argument("--pack-parts", default=None, help="pack / send: only 15 MB parts A..B-1 of the bundle (A:B)")
    ap.add_argument("--eagle3-dir", nargs="+", default=["eagle3"],
                    help="eval: the EAGLE-3 head under /tmp/work; several: each measured at k = 5, the best on "
                         "MT-Bench measured at every k")
    ap.add_argument("--peagle-dir", default="peagle", help="eval: the P-EAGLE head under /tmp/work")
    ap.add_argument("--peagle-init-head", default=None,
                    help="P-EAGLE: start from this head (repo path or absolute): a P-EAGLE head, or an EAGLE-3 head "
                         "of the same --head-intermediate, whose layers, fc and LM head it takes")
    ap.add_argument("--peagle-chain-weight", action="store_true",
                    help="P-EAGLE: weight each slot's loss by the head's chance of reaching it (TrainDraftConfig)")
    ap.add_argument("--peagle-only", action="store_true", help="train P-EAGLE on the data an earlier call of this "
                    "warm machine generated (/tmp/work/eagle3), or --data")
    ap.add_argument("--data", nargs="+", default=None,
                    help="reuse data_train.npz / data_held_out.npz from these repo paths (concatenated)")
    ap.add_argument("--extra-data", nargs="+", default=[],
                    help="earlier runs' sample directories (repo paths) appended to the training split")
    ap.add_argument("--dataset-answers", action="store_true", help="also train on the prompt files' own answers")
    ap.add_argument("--eval-every", type=int, default=0, help="held-out estimate every N steps; keep the best")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--max-turns", type=int, default=3, help="generate: user turns answered per conversation")
    ap.add_argument("--answers-per-conversation", type=int, default=1,
                    help="generate: answers per training conversation (the further ones sampled)")
    ap.add_argument("--shards", type=int, default=1, help="generate: processes sharing the GPU")
    ap.add_argument("--device", default="cuda", help="generate / speed: where the target runs (cpu: a wiring check)")
    ap.add_argument("--kv-gib", type=float, default=80.0, help="generate: KV cache, split among the shards")
    ap.add_argument("--shard", type=int, default=None, help=argparse.SUPPRESS)  # one shard's process
    ap.add_argument("--sources", nargs="+", default=TRAIN_SOURCES,
                    help="generate: prompt sources under the staged data (default: every training source)")
    ap.add_argument("--held-out-from", default=None,
                    help="generate: keep this earlier run's held-out split (a repo path holding data_held_out.npz)")
    ap.add_argument("--self-prompts", type=int, default=0,
                    help="generate: requests the target writes itself first (train/self_prompts.py), split among "
                         "the shards, kept free of the evaluation sets' n-grams; source name self_prompts")
    ap.add_argument("--self-prompt-temperature", type=float, default=1.0)
    ap.add_argument("--self-prompt-top-p", type=float, default=0.95)
    ap.add_argument("--answers-per-source", default="",
                    help="generate: NAME=N,... answers for conversations of prompt files whose name holds NAME")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--memory-fraction", type=float, default=0.0,
                    help="train: cap this process's share of GPU memory (several processes training side by side)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--weight-decay", type=float, default=0.0, help="train: AdamW weight decay (TrainDraftConfig)")
    ap.add_argument("--hard-label-weight", type=float, default=0.0,
                    help="train: label mass moved onto the target's argmax (TrainDraftConfig.hard_label_weight)")
    ap.add_argument("--per-file", type=int, default=800)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--peagle-layers", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--gsm8k-limit", type=int, default=200)
    ap.add_argument("--sampled-temperature", type=float, default=0.0,
                    help="eval, several --eagle3-dir: also each candidate's k = 5 AL at this temperature (seed 0); "
                         "speed: also sampled rows at this temperature")
    ap.add_argument("--budget", type=float, default=420)
    ap.add_argument("--heads", type=Path, default=None)
    ap.add_argument("--eagle3-head", default="heads/smollm2-135m-instruct-eagle3", help="speed: the head (repo path)")
    ap.add_argument("--c1-prompts", type=int, default=12, help="speed: prompts per set run one at a time")
    ap.add_argument("--c8-prompts", type=int, default=32, help="speed: prompts per set run eight at a time")
    ap.add_argument("--modes", default="c1,c8,all", help="speed: which of c1, c8, all to run")
    ap.add_argument("--repeats", type=int, default=1,
                    help="speed: timed runs of every row, the rows of a set and mode interleaved; a row reports the "
                         "median tokens/s (tok_s_runs: each run's; speedup_vs_plain_runs: run i against plain's run "
                         "i), an adaptive row a fresh policy each run; seconds, tokens, AL and outputs are the last "
                         "run's")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    {"split": lambda: split(args.part_mb, args.data_dir), "stage": lambda: stage(),
     "generate": lambda: generate(args), "train": lambda: train(args),
     "eval": lambda: evaluate(args), "speed": lambda: speed(args),
     "pack": lambda: pack({n: json.loads((WORK / n / "train_report.json").read_text()) for n in args.pack},
                          args.pack_parts),
     "send": lambda: send_parts("-".join(args.pack), args.pack_parts)}[
        args.phase]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
