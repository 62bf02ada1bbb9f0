"""A tensor-parallel rank > 0 (tensor_parallel.py starts it): its process's entry point and the loop that runs rank
0's commands, in order, until STOP or until rank 0 is gone."""
import datetime
import logging
import os
import pickle
import sys
import threading
import time

import torch
import torch.distributed as dist

from tidepool.workers.engine.model_runner import ModelRunner
from tidepool.workers.engine.models.sharding import Shard
from tidepool.workers.engine.shm_collectives import RankFailure, ShmCollectives
from tidepool.workers.engine.tensor_parallel import (CONTINUE, LORA, MOVE, RENDEZVOUS_S, RUN, STOP, Channel,
                                                     Collectives, _device, _groups, bind_process)

log = logging.getLogger(__name__)


def _exit_with_parent(parent: int) -> None:
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def follower_main() -> None:
    """A rank > 0 (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment; the engine config, its cores,
    the shared-memory file and rank 0's pid pickled on stdin): load its shard, then run rank 0's commands until
    STOP, or until rank 0 is gone."""
    config, cores, shm_path, shm_bytes, parent = pickle.loads(sys.stdin.buffer.read())
    _exit_with_parent(parent)
    logging.basicConfig(level=logging.WARNING)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = _device(config, rank)
    if device.type == "cpu":
        bind_process(cores)
    else:
        torch.cuda.set_device(device)
    shm = shm_path and ShmCollectives.allocate(size, shm_bytes, shm_path)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, False,
                          timeout=datetime.timedelta(seconds=RENDEZVOUS_S))
    group, commands = _groups(store, rank, size, device, config.collective_timeout_s)

    def parent_alive() -> bool:
        return os.getppid() == parent

    comm = Collectives(rank, size, group, config.collective_timeout_s,
                       shm and ShmCollectives(rank, size, *shm, config.collective_timeout_s, parent_alive), commands)
    runner = ModelRunner(config, config.model_config, shard=Shard(rank, size, comm))
    if config.max_loras:
        from tidepool.workers.engine.lora import LoRAManager
        runner.lora = LoRAManager(runner.model, config.model_config, config.max_loras, config.max_lora_rank,
                                  config.max_cpu_loras, runner.device, runner.dtype, runner.shard)
    try:
        Follower(runner, Channel(comm)).serve()
    except RankFailure as exc:
        log.error("tensor-parallel rank %d: %s", rank, exc)
        os._exit(1)


class Follower:
    """A rank > 0's loop: every command rank 0 sends, in order."""

    def __init__(self, runner, channel: Channel):
        self.runner, self.channel = runner, channel

    def serve(self) -> None:
        while True:
            op, ints, payload = self.channel.recv(fast=False)
            if op == STOP:
                return
            self.handle(op, ints, payload)

    def boundary(self, layer: int) -> None:
        """between_layers of a step with a cut armed: run what rank 0 runs there, until it goes on."""
        while True:
            op, ints, payload = self.channel.recv(fast=True)
            if op == CONTINUE:
                return
            self.handle(op, ints, payload)

    def handle(self, op: int, ints: list[int], payload: torch.Tensor | None) -> None:
        if op == RUN:
            self.runner.follow_step(ints, payload, self.boundary)
        elif op == MOVE:
            self.runner.follow_move(ints, payload)
        elif op == LORA:
            self.runner.follow_lora(ints, payload)
        else:
            raise RankFailure(f"unknown tensor-parallel command {op}")
