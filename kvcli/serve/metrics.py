"""GET /metrics: Prometheus text format (exposition 0.0.4) with llama-server's names under `kvcli:`."""

from __future__ import annotations


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0


def render(engine) -> str:
    """The engine's counters and cache figures; every metric with its # HELP and # TYPE lines."""
    cache = engine.cache_stats()
    rows = [
        ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", engine.prompt_tokens_total),
        ("prompt_seconds_total", "counter", "Prompt process time.", engine.prompt_seconds_total),
        ("tokens_predicted_total", "counter", "Number of generation tokens processed.", engine.predicted_tokens_total),
        ("tokens_predicted_seconds_total", "counter", "Predict process time.", engine.predicted_seconds_total),
        ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
         _rate(engine.prompt_tokens_total, engine.prompt_seconds_total)),
        ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s (all slots together).",
         _rate(engine.predicted_tokens_total, engine.predicted_seconds_total)),
        ("requests_processing", "gauge", "Number of requests processing.", engine.processing()),
        ("requests_deferred", "gauge", "Number of requests deferred (waiting for a slot).", engine.deferred()),
        ("kv_cache_bytes", "gauge", "Bytes allocated by all slots' caches.", cache["bytes"]),
        ("kv_cache_bytes_in_use", "gauge", "Cache bytes holding positions (plus the fixed f16 windows).",
         cache["bytes_in_use"]),
        ("kv_cache_cells", "gauge", "Cache cells (positions) of all slots.", cache["cells"]),
        ("kv_cache_cells_in_use", "gauge", "Cache cells holding a position.", cache["cells_in_use"]),
    ]
    if engine.ram is not None:
        ram = engine.ram.stats()
        rows += [
            ("prompt_cache_ram_bytes", "gauge", "Bytes held by the host-RAM prompt cache (--cache-ram).", ram["bytes"]),
            ("prompt_cache_ram_entries", "gauge", "Conversations the host-RAM prompt cache holds.", ram["entries"]),
            ("prompt_cache_ram_hits_total", "counter", "Requests started from a prefix in the host-RAM prompt cache.",
             ram["hits"]),
            ("prompt_cache_ram_lookups_total", "counter", "Requests that looked in the host-RAM prompt cache.",
             ram["lookups"]),
            ("prompt_cache_ram_hit_rate", "gauge", "Hits over lookups of the host-RAM prompt cache.", ram["hit_rate"]),
        ]
    out = []
    for name, kind, help_text, value in rows:
        out += [f"# HELP kvcli:{name} {help_text}", f"# TYPE kvcli:{name} {kind}", f"kvcli:{name} {value}"]
    return "\n".join(out) + "\n"
