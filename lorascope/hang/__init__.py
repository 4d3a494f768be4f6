"""`lorascope hang`: take live evidence from a hung job's ranks and diagnose it."""
