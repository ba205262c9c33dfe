"""The benchmark runner's quick mode runs every measurement (figures come from full runs)."""

import subprocess
import sys

from conftest import ROOT


def test_benchmarks_quick_mode_runs_every_measurement():
    r = subprocess.run([sys.executable, "-m", "benchmarks", "--quick"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for section in ("1. resolution done", "2. apply done", "3. training steps done", "4. cost model done",
                    "5. generation done"):
        assert section in r.stdout
    assert "targets met" in r.stdout
