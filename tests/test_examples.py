"""Every example script runs (quick mode) as a user runs it, and its own check against
the single-device model passes (the scripts exit non-zero on a mismatch)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXAMPLES = [
    ("demo.py", "MATCH: the distributed program reproduces the single-device run"),
    ("train_resnet.py", "MATCH: equal to single-device training"),
    ("train_hf_causal_lm.py", "MATCH: equal to single-device training"),
    ("inference.py", "MATCH: equal to the single-device model"),
]


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("script,verdict", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_example_runs_and_matches_single_device(script, verdict):
    if script not in ("demo.py", "train_resnet.py"):
        pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), "--quick"],
                          capture_output=True, text=True, timeout=380, cwd=ROOT, env=env)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert verdict in done.stdout
