"""The run directory: lorascope's one data model between the probes and the analysis.

Format v2 is documented in docs/run-format.md. ``schema`` and ``writer`` are imported
inside training jobs and stay standard-library only; ``reader`` is the analysis side.
"""
