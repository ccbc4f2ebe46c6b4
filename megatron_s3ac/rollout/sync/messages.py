"""Small JSON messages between trainer ranks over the default group, as plain tensors (works on gloo and NCCL):
an int64 length, then the UTF-8 bytes. Used by the stage-wise syncs (a stage leader tells the rank that drives
the engines what each bucket holds; that rank answers go / stop). Nothing is pickled."""
from __future__ import annotations

import json

import torch
import torch.distributed as dist


def send_obj(obj, dst: int, dev: torch.device) -> None:
    """``obj`` (JSON-serializable) to global rank ``dst``; tensors on ``dev`` (the current CUDA device on NCCL)."""
    data = json.dumps(obj).encode()
    dist.send(torch.tensor([len(data)], dtype=torch.int64, device=dev), dst=dst)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev), dst=dst)


def recv_obj(src: int, dev: torch.device):
    """The object ``send_obj`` sent from global rank ``src``."""
    n = torch.empty(1, dtype=torch.int64, device=dev)
    dist.recv(n, src=src)
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=dev)
    dist.recv(buf, src=src)
    return json.loads(bytes(buf.cpu().numpy()).decode())
