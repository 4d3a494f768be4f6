"""Chart data for kernels (ops on a CPU run): duration histogram, tiny share, LoRA share.

The section renders from one documented shape, the **kernel table**, which a detector
puts in ``Finding.details["kernels"]`` (the tiny-kernel-tail detector does the
attribution) or which :mod:`lorascope.detect.kernel_attribution` derives from the Kineto traces
in ``EvidenceBundle.traces``::

    {
      "unit": "kernel",              # "kernel" (GPU kernels) or "op" (CPU ops, CPU-only run)
      "threshold_us": 10.0,          # what counts as tiny, in microseconds
      "window": "steps 6-7",         # optional: what the trace covers
      "ranks": {                     # keyed by rank (int or str)
        "0": {
          "source": "ranks/rank-0/h-1.trace.json.gz",   # optional: where it comes from
          "steps": 2,                                    # optional: steps in the trace
          "rows": [                                      # one row per (name, module)
            {"name": "aten::mm", "module": "lora_A",     # "lora_A", "lora_B", "lora" (other
             "durations_us": [3.1, 2.9]}                 #  LoRA parts), "base", or null
          ]
        }
      }
    }

The page shows the histogram over all ranks with log-spaced bins (four per decade, one
edge exactly at the threshold), each bin split into LoRA and other; per rank the count
and time shares under the threshold and attributed to LoRA; the top names by time.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from lorascope.detect.finding import Finding

BINS_PER_DECADE = 4
TOP_NAMES = 15
LORA_MODULES = frozenset({"lora_A", "lora_B", "lora"})


def find_table(findings: list[Finding]) -> dict[str, Any] | None:
    for finding in findings:
        table = finding.details.get("kernels")
        if isinstance(table, dict) and isinstance(table.get("ranks"), dict):
            return table
    return None


def _bin_index(dur: float, threshold: float) -> int:
    """Bin k holds [threshold·10^(k/4), threshold·10^((k+1)/4)); k < 0 is under the threshold."""
    return math.floor(math.log10(max(dur, 1e-3) / threshold) * BINS_PER_DECADE + 1e-9)


def _edge(k: int, threshold: float) -> float:
    return threshold * 10 ** (k / BINS_PER_DECADE)


def section(table: dict[str, Any] | None, message: str) -> dict[str, Any]:
    """The histogram, the per-rank shares and the top names; or ``message`` when no table."""
    if table is None:
        return {"available": False, "message": message}
    threshold = float(table["threshold_us"])
    lora_bins: dict[int, int] = defaultdict(int)
    other_bins: dict[int, int] = defaultdict(int)
    names: dict[tuple[str, str | None], list[float]] = defaultdict(lambda: [0, 0.0])
    shares = []
    for rank_key, per in sorted(table["ranks"].items(), key=lambda kv: int(kv[0])):
        count = tiny = lora = 0
        time = tiny_t = lora_t = 0.0
        for row in per.get("rows", []):
            module = row.get("module")
            is_lora = module in LORA_MODULES
            durs = [float(d) for d in row.get("durations_us", []) if isinstance(d, (int, float)) and 0 <= d < 1e15]
            agg = names[(str(row.get("name")), module)]
            agg[0] += len(durs)
            agg[1] += math.fsum(durs)
            for d in durs:
                k = _bin_index(d, threshold)
                (lora_bins if is_lora else other_bins)[k] += 1
                count += 1
                time += d
                if d < threshold:
                    tiny += 1
                    tiny_t += d
                if is_lora:
                    lora += 1
                    lora_t += d
        shares.append(
            {
                "rank": int(rank_key),
                "count": count,
                "time_us": round(time, 1),
                "steps": per.get("steps"),
                "source": per.get("source"),
                "tiny_count": _share(tiny, count),
                "tiny_time": _share(tiny_t, time),
                "lora_count": _share(lora, count),
                "lora_time": _share(lora_t, time),
            }
        )
    ks = sorted(set(lora_bins) | set(other_bins))
    bins = (
        [
            {
                "lo": round(_edge(k, threshold), 4),
                "hi": round(_edge(k + 1, threshold), 4),
                "lora": lora_bins.get(k, 0),
                "other": other_bins.get(k, 0),
            }
            for k in range(ks[0], ks[-1] + 1)
        ]
        if ks
        else []
    )
    top = sorted(names.items(), key=lambda kv: (-kv[1][1], kv[0][0]))[:TOP_NAMES]
    return {
        "available": bool(bins),
        "message": None if bins else "the kernel trace holds no durations",
        "unit": table.get("unit", "kernel"),
        "threshold_us": threshold,
        "window": table.get("window"),
        "bins": bins,
        "threshold_bin": next((i for i, b in enumerate(bins) if b["lo"] >= threshold * 0.999), len(bins)),
        "ranks": shares,
        "top": [
            {
                "name": n,
                "module": m,
                "count": int(c),
                "total_us": round(t, 1),
                "mean_us": round(t / c, 2) if c else None,
            }
            for (n, m), (c, t) in top
        ],
    }


def _share(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None
