"""HolisticTraceAnalysis (HTA) figures, when it is installed and accepts the traces.

HTA (the ``analysis`` extra) parses GPU traces into dataframes and gives two figures the
plain reader does not: the temporal breakdown (GPU idle / compute / non-compute time)
and kernel launch statistics, including its own "short kernel" rule: a kernel whose
GPU time is shorter than the CPU launch that queued it, for launches of at most
:data:`SHORT_LAUNCH_US`. That rule counts very differently from a plain duration
threshold, and HTA drops kernels whose launch it cannot match (on ROCm traces: all of
them), so lorascope reports it next to its own numbers, never instead of them.

HTA rejects CPU-only traces (it raises on them); the reason is kept and the analysis goes
on without it. Importing HTA costs over a second (pandas, plotly), so it is imported
here, lazily, and only when asked for.
"""

from __future__ import annotations

import contextlib
import io
import logging
import traceback
from dataclasses import dataclass
from pathlib import Path

SHORT_LAUNCH_US = 50
LONG_DELAY_US = 100


@dataclass
class HtaFigures:
    """HTA's view of one rank's GPU trace."""

    idle_us: float
    compute_us: float
    non_compute_us: float
    kernel_us: float
    #: Kernels HTA matched to their CPU launch (the launch statistics cover only these).
    launches_matched: int
    #: HTA's short-kernel rule: GPU time < CPU launch time, launch <= SHORT_LAUNCH_US.
    short_kernels: int
    #: Launch-to-start delays over LONG_DELAY_US.
    long_launch_delays: int


def hta_available() -> bool:
    try:
        import hta  # noqa: F401
    except ImportError:
        return False
    return True


def why_failed(exc: BaseException) -> str:
    """The exception in a line; where it was raised when it has no message (HTA's own
    ``assert``s do not: on the GPU check's trace, "assert non_compute_time >= 0" in its
    temporal breakdown read "AssertionError: ")."""
    text = str(exc)[:120]
    if not text:
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            last = frames[-1]
            text = f"at {'/'.join(Path(last.filename).parts[-3:])}:{last.lineno}" + (
                f": {last.line.strip()[:80]}" if last.line else ""
            )
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__


def hta_figures(files: dict[int, Path]) -> tuple[dict[int, HtaFigures], str | None]:
    """Figures per rank, and why there are none when HTA refused (None when it worked)."""
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        return {}, "holistictraceanalysis is not installed (pip install 'lorascope[analysis]')"
    quiet = io.StringIO()
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            analysis = TraceAnalysis(trace_files={r: str(p.resolve()) for r, p in files.items()}, trace_dir="/")
            breakdown = analysis.get_temporal_breakdown(visualize=False)
            launches = analysis.get_cuda_kernel_launch_stats(ranks=sorted(files), visualize=False)
    except Exception as exc:
        return {}, f"HTA rejected the traces ({why_failed(exc)})"
    finally:
        logging.disable(previous)
    out: dict[int, HtaFigures] = {}
    for row in breakdown.to_dict("records"):
        rank = int(row["rank"])
        df = launches.get(rank)
        matched = 0 if df is None else len(df)
        short = (
            0 if df is None else int(((df.gpu_duration < df.cpu_duration) & (df.cpu_duration <= SHORT_LAUNCH_US)).sum())
        )
        delays = 0 if df is None else int((df.launch_delay > LONG_DELAY_US).sum())
        out[rank] = HtaFigures(
            idle_us=float(row["idle_time(us)"]),
            compute_us=float(row["compute_time(us)"]),
            non_compute_us=float(row["non_compute_time(us)"]),
            kernel_us=float(row["kernel_time(us)"]),
            launches_matched=matched,
            short_kernels=short,
            long_launch_delays=delays,
        )
    return out, None
