"""Deferred, sync-free reads of per-step device scalars (loss, accuracies, grad norm, ...).

The drafter worker stacks its step metrics into one small 1-D device tensor and `push`es it here:
a non-blocking copy into a preallocated (pinned, on CUDA) host slot plus one CUDA event recorded on
the current stream. Nothing waits. The monitor thread later `drain`s the slots whose event has
completed (`Event.query()`, a non-blocking cudaEventQuery) and reads them as plain host memory
through a numpy view, so draining dispatches no torch op at all (docs/design/observability.md §3.4).

Concurrency: one producer (the worker), one consumer (the monitor). `_head` counts pushes, `_tail`
counts consumed slots; slot of sequence number n is n % capacity. The only state both threads write
is `_tail` (the producer advances it when it overwrites an unread slot), so index bookkeeping sits
under a tiny lock held for a few integer operations. The monitor copies a ready slot's values while
holding the lock, so a concurrent push can never overwrite a slot halfway through being read.
If the worker laps the monitor, the OLDEST unread sample is dropped and counted: never wait.
"""

from __future__ import annotations

import threading
from typing import Any

import torch


class ScalarRing:
    def __init__(self, names: list[str], capacity: int = 64, device: torch.device | str = "cpu"):
        if capacity < 2:
            raise ValueError(f"ScalarRing capacity must be >= 2, got {capacity}")
        if not names:
            raise ValueError("ScalarRing needs at least one metric name")
        self.names = list(names)
        self.capacity = capacity
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        # Pinned memory makes the D2H copy truly asynchronous; pageable + non_blocking silently
        # becomes a synchronous copy (docs/design/observability.md §8.1).
        self._buf = torch.zeros(
            capacity, len(self.names), dtype=torch.float32, pin_memory=self._cuda
        )
        self._np = self._buf.numpy()  # shares memory with _buf: reads dispatch no torch op
        self._rows = [self._buf[i] for i in range(capacity)]  # prebuilt views: no slicing per push
        self._steps = [0] * capacity
        self._events: list[Any] = (  # torch.cuda.Event per slot on CUDA
            [torch.cuda.Event() for _ in range(capacity)] if self._cuda else [None] * capacity
        )
        self._head = 0  # next sequence number to write (producer)
        self._tail = 0  # next sequence number to read (consumer; producer on overflow)
        self._lock = threading.Lock()
        self.pushed = 0
        self.dropped = 0  # samples overwritten before the monitor drained them

    def push(self, step: int, values: torch.Tensor) -> None:
        """Worker side: enqueue one step's metrics without any host-device synchronisation.

        `values` is 1-D with len(names) elements on any device/dtype; only its (host-side) shape is
        inspected. Call after the ops producing `values` were issued on the current stream.
        """
        if values.dim() != 1 or values.shape[0] != len(self.names):
            raise ValueError(
                f"ScalarRing.push expects shape [{len(self.names)}] for {self.names}, "
                f"got {tuple(values.shape)}"
            )
        if isinstance(step, torch.Tensor):
            raise TypeError("ScalarRing.push: step must be a Python int (int(tensor) syncs)")
        if values.is_cuda and not self._cuda:
            # A pageable D2H copy would block the worker: the ring must be built for CUDA.
            raise ValueError("ScalarRing built for a CPU device got a CUDA tensor; pass device=")
        with self._lock:
            seq = self._head
            if seq - self._tail >= self.capacity:  # the slot to overwrite is still unread
                self._tail += 1
                self.dropped += 1
            slot = seq % self.capacity
            self._steps[slot] = int(step)
            # Copy and event record stay under the lock so the consumer can never see this slot's
            # new step with the previous event (or read it before the copy was issued).
            self._rows[slot].copy_(values.detach(), non_blocking=self._cuda)
            if self._cuda:
                self._events[slot].record(torch.cuda.current_stream(self.device))
            self._head = seq + 1
            self.pushed += 1

    def drain(self, limit: int | None = None) -> list[tuple[int, dict[str, float]]]:
        """Monitor side: completed samples in FIFO order; stops at the first one still in flight."""
        out: list[tuple[int, dict[str, float]]] = []
        names = self.names
        with self._lock:
            while self._tail < self._head and (limit is None or len(out) < limit):
                slot = self._tail % self.capacity
                ev = self._events[slot]
                if ev is not None and not ev.query():  # copy not finished yet: try next tick
                    break
                out.append((self._steps[slot], dict(zip(names, self._np[slot].tolist()))))
                self._tail += 1
        return out

    def pending(self) -> int:
        return self._head - self._tail
