"""Reading a run directory back: the per-rank reader, its reduction and alignment.

The analysis side only; it imports :mod:`lorascope.rundir.format`, never the reverse.
"""
