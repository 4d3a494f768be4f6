"""lorascope: diagnostic profiler and post-mortem analyzer for distributed LoRA fine-tuning.

Importing this package is cheap on purpose (it runs inside training jobs): the probes
are imported only when :func:`attach` is called.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.3.0"

__all__ = ["__version__", "attach"]


def attach(out: str | None = None, **options: Any) -> bool:
    """Attach the always-on probes to this process (one line in a training script).

    ``out`` is the run directory (default: ``$LORASCOPE_RUN_DIR`` or ``lorascope-runs/<time>``).
    Options: ``sample_interval`` (seconds between background memory samples).
    Calling it again, or in a process `lorascope run` already probes, is harmless.
    Returns True when the probes are active in this process. Never raises.
    """
    from lorascope.probes.attach import attach as _attach

    return _attach(out, **options)
