"""Cost per 1M output tokens from an hourly price and a measured throughput, beside hosted-API list prices.

The API price table lives in ``api_prices.json`` (dated, with sources), never in code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

API_PRICES_PATH = Path(__file__).with_name("api_prices.json")


def load_api_prices(path: str | Path | None = None) -> dict[str, Any]:
    """The dated, sourced API price table (``api_prices.json`` unless ``path`` is given)."""
    return json.loads(Path(path or API_PRICES_PATH).read_text())


def usd_per_million_tokens(usd_per_hour: float, output_tok_s: float) -> float | None:
    """What one million output tokens cost on a machine rented at ``usd_per_hour`` producing ``output_tok_s``."""
    if output_tok_s <= 0:
        return None
    return usd_per_hour / (output_tok_s * 3600.0) * 1e6


def level_cost(usd_per_hour: float | None, output_tok_s: float, api_prices: dict[str, Any]) -> dict[str, Any] | None:
    """The level's cost per 1M output tokens and, for each API model, how many times cheaper (> 1) it is."""
    if usd_per_hour is None:
        return None
    cost = usd_per_million_tokens(usd_per_hour, output_tok_s)
    vs = {p["model"]: (p["output_usd_per_mtok"] / cost if cost else None) for p in api_prices.get("prices", [])}
    return {"usd_per_hour": usd_per_hour, "usd_per_million_output_tokens": cost, "api_price_over_ours": vs}
