"""The hang diagnosis, one home: where ranks' collectives diverge (run records and
flight-recorder dumps), which rank condition a call site sits in, and why a job is stuck.
Used by the hang detectors, `lorascope hang` and the report."""
