"""``bench server``'s pure parts: the workload, reading one answer, /metrics, summaries, verdicts.

No server and no SGLang here (tests/bench/test_bench_server.py covers them). The workload
overflows the device pool (8,192 tokens) and the host pool (2x) so that re-sent prompts can only
come back from L3:

  fill     ``fill`` distinct prompts of ``prompt_tokens`` random ids
  mixed    the first ``resend`` fill prompts again, each followed by a fresh prompt of the same
           length (recomputed everywhere: the baseline of the same moment)
  changed  the first fill prompt with one early token changed: its pages' keys all differ, so
           no tier may serve it, and its answer must differ from the original's
"""

from __future__ import annotations

import random
import re
import statistics

PHASES = ("fill", "resent", "fresh", "changed")
CHANGED_AT = 5  # the token changed in the "changed" prompt: inside the first page


def make_workload(*, seed: int, prompt_tokens: int, fill: int, resend: int, fresh: int,
                  vocab: int = 32000) -> list[dict]:
    """The requests in order: ``{"phase", "name", "ids", "of"}`` (``of``: the fill prompt a
    re-sent or changed one repeats). Token ids avoid 0-2 (pad / bos / eos in a Llama config)."""
    if not 0 < resend <= fill:
        raise ValueError(f"resend must be 1..fill ({fill}), got {resend}")
    if prompt_tokens <= CHANGED_AT or fresh < 0:
        raise ValueError(f"prompt_tokens must exceed {CHANGED_AT} and fresh be >= 0, got {prompt_tokens}, {fresh}")
    rng = random.Random(seed)

    def prompt():
        return [rng.randrange(3, vocab) for _ in range(prompt_tokens)]

    fills = [prompt() for _ in range(fill)]
    out = [{"phase": "fill", "name": f"fill{i}", "ids": ids, "of": None} for i, ids in enumerate(fills)]
    for i in range(max(resend, fresh)):
        if i < resend:
            out.append({"phase": "resent", "name": f"resent{i}", "ids": fills[i], "of": f"fill{i}"})
        if i < fresh:
            out.append({"phase": "fresh", "name": f"fresh{i}", "ids": prompt(), "of": None})
    changed = list(fills[0])
    changed[CHANGED_AT] = 3 + (changed[CHANGED_AT] - 3 + 1) % (vocab - 3)
    out.append({"phase": "changed", "name": "changed0", "ids": changed, "of": "fill0"})
    return out


def parse_answer(chunks: list[tuple[float, dict]], sent_at: float = 0.0) -> dict:
    """One streamed ``/generate`` answer (``(arrival time, decoded JSON)`` per ``data:`` line, in
    order) -> ttft_s, e2e_s, output_ids, cached tokens per tier. Outputs accumulate: the last
    chunk holds them all. Raises ValueError for an answer without a chunk or with an error."""
    if not chunks:
        raise ValueError("the server sent no data chunk")
    last = chunks[-1][1]
    if "error" in last or "meta_info" not in last:
        raise ValueError(f"the server answered an error: {str(last)[:300]}")
    meta = last["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    return {
        "ttft_s": chunks[0][0] - sent_at,
        "e2e_s": chunks[-1][0] - sent_at,
        "output_ids": list(last.get("output_ids") or []),
        "prompt_tokens": int(meta.get("prompt_tokens", 0)),
        "cached_tokens": int(meta.get("cached_tokens", 0) or 0),
        "device_tokens": int(details.get("device", 0) or 0),
        "host_tokens": int(details.get("host", 0) or 0),
        "storage_tokens": int(details.get("storage", 0) or 0),
        "storage_backend": details.get("storage_backend"),
        "prefetch_wait_s": float(meta.get("storage_prefetch_wait", 0.0) or 0.0),
        "queue_s": float(meta.get("queue_time", 0.0) or 0.0),  # waiting to be scheduled (prefetch included)
    }


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")

# /metrics families bench server reports (summed over their labels unless a label is named)
METRICS = {
    "storage_prefetch_hit_tokens": ("sglang:storage_prefetch_hit_tokens_total", None),
    "storage_hit_prefill_tokens": ("sglang:prefill_effective_tokens_total", 'mode="storage_hit"'),
    "hicache_backup_bytes": ("sglang:hicache_backup_bytes_total", None),
    "umbp_gets": ("umbp_nvme_gets_total", None),
    "umbp_hits": ("umbp_nvme_hits_total", None),
    "umbp_puts": ("umbp_nvme_puts_total", None),
}


def parse_metrics(text: str) -> dict:
    """Prometheus text -> the ``METRICS`` figures (absent family: 0.0)."""
    out = {k: 0.0 for k in METRICS}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        for key, (family, label) in METRICS.items():
            if name == family and (label is None or label in labels):
                try:
                    out[key] += float(value)
                except ValueError:
                    pass
    return out


def metrics_delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in METRICS}


def _median(xs):
    return statistics.median(xs) if xs else None


def summarize(records: list[dict]) -> dict:
    """Per phase: count, TTFT / e2e medians (ms), tokens served per tier, prefill tok/s
    (prompt tokens not served from a cache / TTFT, median)."""
    out = {}
    for phase in PHASES:
        rs = [r for r in records if r["phase"] == phase and "error" not in r]
        if not rs:
            continue
        out[phase] = {
            "n": len(rs),
            "ttft_ms": _median([r["ttft_s"] * 1e3 for r in rs]),
            "e2e_ms": _median([r["e2e_s"] * 1e3 for r in rs]),
            "storage_tokens": sum(r["storage_tokens"] for r in rs),
            "host_tokens": sum(r["host_tokens"] for r in rs),
            "device_tokens": sum(r["device_tokens"] for r in rs),
            "queue_ms": _median([r.get("queue_s", 0.0) * 1e3 for r in rs]),
            "prefetch_wait_ms": _median([r.get("prefetch_wait_s", 0.0) * 1e3 for r in rs]),
            "prefill_tok_s": _median([(r["prompt_tokens"] - r["cached_tokens"]) / r["ttft_s"]
                                      for r in rs if r["ttft_s"] > 0]),
        }
    return out


def l3_servable(prompt_tokens: int, page_size: int) -> int:
    """The tokens a cache can serve of a prompt: its full pages, short of the last token (SGLang
    computes at least one token itself, so a prompt of exactly N pages is served N - 1)."""
    return (prompt_tokens - 1) // page_size * page_size


def check_answers(records: list[dict], page_size: int) -> dict:
    """What the run must show: each re-sent prompt's greedy output equals its first answer, how
    many re-sent prompts L3 served (``l3_servable`` tokens each), and that the changed prompt got no cached page and a different answer."""
    first = {r["name"]: r for r in records if r["phase"] == "fill" and "error" not in r}
    resent = [r for r in records if r["phase"] == "resent"]
    same = [r for r in resent if "error" not in r and r["of"] in first
            and r["output_ids"] == first[r["of"]]["output_ids"]]
    l3 = [r for r in resent if "error" not in r
          and r["storage_tokens"] >= l3_servable(r["prompt_tokens"], page_size) > 0]
    changed = [r for r in records if r["phase"] == "changed" and "error" not in r]
    return {
        "resent": len(resent),
        "resent_identical": len(same),
        "resent_l3": len(l3),
        "changed_uncached": sum(r["cached_tokens"] < page_size for r in changed),
        "changed_differs": sum(r["of"] in first and r["output_ids"] != first[r["of"]]["output_ids"] for r in changed),
        "errors": sum("error" in r for r in records),
    }


def ratio(a, b):
    return None if a is None or not b else a / b


def verdicts(rounds: list[dict]) -> list[dict]:
    """The issue's targets over the rounds (each ``{"arms": {arm: {"summary", "checks"}}}``):
    ratios are medians of per-round ratios (arms of one round ran back to back)."""
    def per_round(num_arm, num_phase, den_arm, den_phase):
        xs = []
        for r in rounds:
            arms = r.get("arms", {})
            try:
                a = arms[num_arm]["summary"][num_phase]["ttft_ms"]
                b = arms[den_arm]["summary"][den_phase]["ttft_ms"]
            except (KeyError, TypeError):
                continue
            if ratio(a, b) is not None:
                xs.append(a / b)
        return _median(xs), len(xs)

    out = []
    for name, num, den, goal in (
        ("fresh TTFT umbp / l2", ("umbp", "fresh"), ("l2", "fresh"), 1.10),
        ("L3-served TTFT umbp / file", ("umbp", "resent"), ("file", "resent"), 0.8),
        ("L3-served TTFT umbp / recompute (none, resent)", ("umbp", "resent"), ("none", "resent"), 0.6),
        ("L3-served TTFT umbp / fresh (same server)", ("umbp", "resent"), ("umbp", "fresh"), 0.6),
    ):
        value, n = per_round(num[0], num[1], den[0], den[1])
        out.append({"target": name, "value": value, "goal": f"<= {goal}", "rounds": n,
                    "met": None if value is None else value <= goal})
    # the L3's own threads: what the umbp server spends beside its forward pass over what l2's spends,
    # as a share of the umbp server's CPU (TTFT ratios swing with a loaded machine's scheduling; this does not)
    shares = []
    for r in rounds:
        u, b = (r.get("arms", {}).get(a, {}).get("server_cpu") or {} for a in ("umbp", "l2"))
        if u.get("cpu_s") and "rest_s" in b:
            shares.append((u["rest_s"] - b["rest_s"]) / u["cpu_s"])
    value = _median(shares)
    out.append({"target": "L3 threads' CPU share of the server (umbp beside-forward-pass CPU - l2's) / umbp CPU",
                "value": value, "goal": "<= 0.02", "rounds": len(shares), "met": None if value is None else value <= 0.02})
    checks = [r["arms"]["umbp"]["checks"] for r in rounds if "checks" in r.get("arms", {}).get("umbp", {})]
    if checks:
        ok = all(c["resent_l3"] == c["resent"] == c["resent_identical"] and c["resent"] > 0 for c in checks)
        out.append({"target": "umbp: re-sent prompts L3 hits with identical outputs, every round",
                    "value": [f"{c['resent_l3']}/{c['resent']} L3, {c['resent_identical']} identical" for c in checks],
                    "goal": "all", "rounds": len(checks), "met": ok})
    return out
