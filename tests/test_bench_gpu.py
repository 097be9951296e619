"""bench/gpu.py, the check a GPU machine runs (numerics of ddlc on NCCL against eager on the
same GPU, host syncs in the step), runs its comparisons on the CPU with ``--cpu``, so the
script stays working where CI has no GPU; without either it says why it cannot run."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=280, cwd=ROOT, env=env)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_gpu_check_matches_eager_on_the_cpu():
    done = _run("--cpu", "mlp,gpt_lr_schedule,gpt_checkpoint_resumed")
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    for case in ("mlp (1,)", "gpt_lr_schedule (1,)", "gpt_checkpoint_resumed (1,)"):
        assert any(line.startswith(case) and " MATCH " in line for line in done.stdout.splitlines()), case
    assert "ALL MATCH" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
@pytest.mark.timeout(120)
def test_the_gpu_check_without_a_gpu_says_so():
    done = _run()
    assert done.returncode == 2
    assert "needs CUDA: no GPU here" in done.stderr
