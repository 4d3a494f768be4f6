"""The run directory's format: its names, records and the code that writes it.

Imported inside training jobs (the probes and the bootstrap): standard library only, and
nothing from :mod:`lorascope.rundir.loading`.
"""
