"""The run directory: lorascope's one data model between the probes and the analysis.

Documented in docs/run-format.md. Two halves, split by who imports them:
:mod:`lorascope.rundir.format` (names, records, the writer: standard library only, what
the probes import inside a training job) and :mod:`lorascope.rundir.loading` (the reader,
its reduction and alignment: the analysis side, which imports the format, never the
reverse).
"""
