"""The side-by-side benchmark: Graft against EAGLE-3, prompt lookup, suffix decoding and
its own ablations, in one run (``vllm-graft bench``)."""
