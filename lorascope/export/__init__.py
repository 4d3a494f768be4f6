"""lorascope's evidence in the formats of the tools users already use (Perfetto)."""
