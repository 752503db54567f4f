"""Run inside an allocation (``salloc ... python -m tests.launch.slurm_probe DIR GPUS [key=value ...]``):
start the job steps ``SlurmLauncher`` would start for the default run (with the overrides) on
nodes of GPUS GPUs, each with a probe in place of its role process that prints its node and
CUDA_VISIBLE_DEVICES, and print the placement and what each step saw as one JSON object.

The steps run at once (each probe waits for a file that appears once all have started),
so SLURM must hand out the GPUs to concurrent steps, as in a run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from launch.config import load_run_config
from launch.processes import role_counts
from launch.slurm import SlurmLauncher, allocation_nodes, cpus_per_node, node_address
from yatt.placement.nodes import plan_layout

PROBE = (
    'touch "$PROBE_DIR/$SLURM_STEP_ID"; '
    'while [ ! -e "$PROBE_DIR/go" ]; do sleep 0.1; done; '
    'echo "$SLURMD_NODENAME ${CUDA_VISIBLE_DEVICES-none}"'
)


def main() -> int:
    out_dir, gpus = Path(sys.argv[1]), int(sys.argv[2])
    cfg = load_run_config(None, sys.argv[3:])
    nodes = allocation_nodes(os.environ["SLURM_JOB_NODELIST"])
    placement = plan_layout(role_counts(cfg), len(nodes), gpus)
    launcher = SlurmLauncher(
        cfg,
        out_dir,
        placement=placement,
        nodes=nodes,
        addresses=[node_address(n) for n in nodes],
        cpus=cpus_per_node(os.environ["SLURM_JOB_CPUS_PER_NODE"], len(nodes)),
        job_id=os.environ["SLURM_JOB_ID"],
    )
    env = dict(os.environ, PROBE_DIR=str(out_dir))
    procs = {}
    for procs_on_node in placement.nodes:
        for role, index in procs_on_node:
            cmd = launcher.role_command(role, index)
            step = cmd[: cmd.index(sys.executable)]  # the srun part, without the role process
            procs[f"{role}-{index}"] = subprocess.Popen([*step, "bash", "-c", PROBE], stdout=subprocess.PIPE, text=True, env=env)
    started = len(procs)
    while len([p for p in out_dir.iterdir() if p.name != "go"]) < started:
        if any(p.poll() is not None for p in procs.values()):
            break  # a step failed to start: report what came back
        time.sleep(0.1)
    (out_dir / "go").touch()
    result = {}
    for name, p in procs.items():
        stdout, _ = p.communicate(timeout=60)
        result[name] = {"code": p.returncode, "seen": stdout.split()}
    print(json.dumps({"placement": placement.describe(), "steps": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
