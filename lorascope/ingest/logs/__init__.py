"""Job logs: streamed, matched against known failure patterns."""
