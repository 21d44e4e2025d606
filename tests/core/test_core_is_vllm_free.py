import subprocess
import sys


def test_core_and_ops_import_no_vllm():
    code = ("import sys, vllm_graft.core.graft, vllm_graft.core.calibration, vllm_graft.ops; "
            "bad = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
