"""Terminal output: findings, the per-rank summary and artifact summaries as text."""
