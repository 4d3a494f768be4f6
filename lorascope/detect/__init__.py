"""Detectors: pure functions of loaded data (an ``Evidence`` bundle) returning Findings.

One module per failure mode, registered in :data:`lorascope.detect.registry.DETECTORS`.
Detectors never read files; ``lorascope.ingest`` does.
"""
