"""In-job probes. Light on purpose: standard library + psutil at import; torch, deepspeed
and peft are patched only when the job itself imports them (see importhook)."""
