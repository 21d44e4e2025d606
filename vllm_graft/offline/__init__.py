"""Offline runs of an in-process vLLM engine, shared by the command line and the
benchmark harness: the engine and its counters (engine.py), which model a run names
(models.py), the warm-up (warmup.py) and the calibration (calibration.py)."""
