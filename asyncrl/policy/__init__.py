"""Pure rules (no I/O): scheduling and staleness, samplers, failures, GRPO math, packing."""
