"""Training an EAGLE-3 head on the target's own answers (no model hub, CPU-friendly)."""
