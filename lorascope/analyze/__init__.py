"""Analysis of loaded run data (pure functions of what the readers return)."""
