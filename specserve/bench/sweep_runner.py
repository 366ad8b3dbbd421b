"""``specserve bench --sweep``: start a server per grid point, measure it at every concurrency, stop it."""

from __future__ import annotations

import argparse
import asyncio
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specserve.bench.sweep import ManagedServer, find_inflections, free_port, serve_command, sweep_points


def _spec_models(pairs: list[str]) -> dict[str, str]:
    models = {}
    for pair in pairs:
        method, sep, path = pair.partition("=")
        if not sep or not method or not path:
            raise ValueError(f"--spec-model expects METHOD=PATH, got {pair!r}")
        models[method] = path
    return models


async def run_sweep(args: argparse.Namespace, plans: list[Any], extra_body: dict[str, Any], command: str,
                    stop: asyncio.Event, runs: list[dict[str, Any]],
                    save: Callable[[dict[str, Any] | None], None]) -> dict[str, Any]:
    """Measure every grid point into ``runs`` (appended as each finishes); returns the sweep summary."""
    from specserve.bench.cli import bench_one

    spec_models = _spec_models(args.spec_model)
    serve_args = shlex.split(args.serve_args)
    configs: list[dict[str, Any]] = []
    for point in sweep_points(args.spec_methods, args.spec_tokens):
        if stop.is_set():
            break
        port = free_port()
        cmd = serve_command(point, port, serve_args, spec_models)
        log = Path(args.out) / "servers" / f"{point.label.replace(' ', '_').replace('=', '')}.log"
        config: dict[str, Any] = {"label": point.label, "spec_method": point.method,
                                  "num_spec_tokens": point.num_spec_tokens, "serve_command": shlex.join(cmd),
                                  "log": str(log)}
        configs.append(config)
        server = ManagedServer(cmd, port, log)
        try:
            await asyncio.to_thread(server.start, args.server_start_timeout)
            model = args.model or await asyncio.to_thread(server.served_model)
            run = await bench_one(args, plans, extra_body, command, stop, save, server.base_url, model,
                                  server={"spec_method": point.method, "num_spec_tokens": point.num_spec_tokens,
                                          "serve_command": shlex.join(cmd)},
                                  label=point.label)
            runs.append(run)
            save(None)
        except RuntimeError as exc:  # the server did not come up: record it, go on with the grid
            config["error"] = str(exc)
        finally:
            await asyncio.to_thread(server.stop)
    return {"configs": configs, "inflection": find_inflections(runs)}
