"""A tiny training job that saves real PyTorch checkpoints, for the resume tests and the bench.

It trains a small model on the CPU and saves after every step, either with ``torch.save`` (one file
per step, ``model_N.pt``) or with ``torch.distributed.checkpoint`` from two ranks over gloo on
localhost (one directory per step, ``step_N``). The tests SIGKILL it at random moments, so most kills
land during a save; the relaunch passes ``--resume PATH --resume-step N`` (train_launch's resume_args
with ``{checkpoint}`` and ``{step}``), and the job loads that checkpoint and prints what it loaded:

    RESUMED step=N path=PATH       the checkpoint loaded, and the step stored inside it is N
    RESUME FAILED ...              it could not be loaded (a torn one): exit code 3

Old checkpoints are pruned (the newest KEEP stay), as real jobs do.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys

KEEP = 4


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tag", default="")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--format", choices=["torch_save", "dcp"], default="torch_save")
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--floats", type=int, default=1 << 20, help="floats in the model's big tensor")
    parser.add_argument("--resume")
    parser.add_argument("--resume-step", type=int)
    parser.add_argument("--rank", type=int, default=-1)
    return parser.parse_args(argv)


def model_state(torch, floats: int):  # type: ignore[no-untyped-def]
    model = torch.nn.Linear(64, 64)
    model.register_buffer("big", torch.zeros(floats))
    return model


def prune(directory: str, prefix: str) -> None:
    steps = sorted((int(name[len(prefix):].split(".")[0]), name) for name in os.listdir(directory)
                   if name.startswith(prefix) and name[len(prefix):].split(".")[0].isdigit())
    for _step, name in steps[:-KEEP]:
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


def train(args: argparse.Namespace) -> int:
    import torch  # pylint: disable=import-outside-toplevel

    torch.manual_seed(0)
    distributed = args.format == "dcp"
    if distributed:
        import torch.distributed as dist  # pylint: disable=import-outside-toplevel
        import torch.distributed.checkpoint as dcp  # pylint: disable=import-outside-toplevel
        dist.init_process_group("gloo")
    rank = args.rank if distributed else 0
    model = model_state(torch, args.floats)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    if args.resume:
        try:
            if distributed:
                state = {"model": model.state_dict(), "step": torch.tensor(-1)}
                dcp.load(state, checkpoint_id=args.resume)
                model.load_state_dict(state["model"])
                loaded = int(state["step"])
            else:
                state = torch.load(args.resume, weights_only=True)
                model.load_state_dict(state["model"])
                loaded = int(state["step"])
        except Exception as exc:  # pylint: disable=broad-except
            print(f"RESUME FAILED rank={rank} path={args.resume}: {type(exc).__name__}: {exc}", flush=True)
            return 3
        if loaded != args.resume_step:
            print(f"RESUME FAILED rank={rank}: the checkpoint holds step {loaded}, not {args.resume_step}", flush=True)
            return 3
        if rank == 0:
            print(f"RESUMED step={loaded} path={args.resume}", flush=True)
        step = loaded
    while step < args.steps:
        step += 1
        inputs = torch.randn(32, 64)
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.big.add_(1.0)
        if distributed:
            dcp.save({"model": model.state_dict(), "step": torch.tensor(step)},
                     checkpoint_id=os.path.join(args.dir, f"step_{step}"))
            if rank == 0:
                prune(args.dir, "step_")
        else:
            torch.save({"model": model.state_dict(), "step": step}, os.path.join(args.dir, f"model_{step}.pt"))
            prune(args.dir, "model_")
        if rank == 0:
            print(f"step {step} saved", flush=True)
    return 0


def launch_ranks(args: argparse.Namespace, argv: list[str]) -> int:
    """Two ranks over gloo on localhost, as torchrun would start them; ends with the worst exit code."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
        ranks.append(subprocess.Popen([sys.executable, __file__, *argv, "--rank", str(rank)], env=env))  # pylint: disable=consider-using-with
    codes = [process.wait() for process in ranks]
    return max(codes, key=abs)


def main(argv: list[str]) -> int:
    args = parse(argv)
    os.makedirs(args.dir, exist_ok=True)
    if args.format == "dcp" and args.rank < 0:
        return launch_ranks(args, argv)
    return train(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
