"""Prefetcher: a reader's batches, transformed by background worker threads, `depth` batches ahead.

Stages, each overlapping the next: the reader decodes Parquet windows in its own thread
(`ParquetReader(prefetch=...)`); one producer thread cuts batches (KJTs) from them and snapshots the
reader's position after each; `workers` threads apply `transform` to batches in flight (e.g. building
the SparseCore CSR inputs, which the caller supplies: this layer knows nothing of kernels). Results
come back in reader order. Threads, not processes: pyarrow, numpy's sort and the compiled CSR build
release the GIL, and the results (tensors of a few MB per batch) then need no copy between processes.

Resume: `state_dict()` is the reader's position after the last batch *handed out*, not after the
batches decoded ahead, so a checkpoint taken between steps resumes at exactly the next untrained
batch. Iterating runs epoch after epoch (`epochs=None`) or the given number of epochs.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tpurec.errors import UserError

_END = object()


class Prefetcher:
    """Batches of `reader` (a ParquetReader, or anything with __iter__/state_dict/load_state_dict),
    passed through `transform` (None: as they are) `depth` batches ahead on `workers` threads."""

    def __init__(
        self,
        reader: Any,  # a ParquetReader, or anything with __iter__, state_dict and load_state_dict
        transform: Callable | None = None,
        *,
        depth: int = 4,
        workers: int = 1,
        epochs: int | None = None,
    ) -> None:
        if depth < 1 or workers < 1:
            raise UserError(f"depth and workers must be >= 1, got {depth}, {workers}")
        self.reader, self.transform = reader, transform
        self.depth, self.workers, self.epochs = depth, workers, epochs
        self._state = reader.state_dict()  # position after the last batch handed out
        self._running: _Run | None = None

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        """Only between iterations (after close() or before the first)."""
        self.close()
        self.reader.load_state_dict(state)
        self._state = self.reader.state_dict()

    def close(self) -> None:
        """Stop the background threads; batches prepared ahead are dropped and the reader is put
        back at the position of the last batch handed out."""
        run, self._running = self._running, None
        if run is not None:
            run.stop()
            self.reader.load_state_dict(self._state)

    def __iter__(self) -> Iterator[Any]:
        self.close()
        run = self._running = _Run(self)
        try:
            while True:
                item = run.next()
                if item is _END:
                    return
                result, state = item
                self._state = state
                yield result
        finally:
            if self._running is run:
                run.stop()
                self._running = None

    def __del__(self) -> None:
        run = getattr(self, "_running", None)
        if run is not None:
            run.stop()


class _Run:
    """One iteration's threads: the producer feeds a bounded queue of (future, reader state)."""

    def __init__(self, owner: Prefetcher) -> None:
        self.owner = owner
        self.q: queue.Queue = queue.Queue(maxsize=owner.depth)
        self.stop_event = threading.Event()
        self.pool = ThreadPoolExecutor(owner.workers, thread_name_prefix="tpurec-pipeline") if owner.transform else None
        self.thread = threading.Thread(target=self._produce, daemon=True, name="tpurec-pipeline-producer")
        self.thread.start()

    def _put(self, item: object) -> bool:
        while not self.stop_event.is_set():
            try:
                self.q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        o = self.owner
        try:
            epoch, empty = 0, 0
            while o.epochs is None or epoch < o.epochs:
                n = 0
                for batch in o.reader:
                    n += 1
                    state = o.reader.state_dict()  # the generator is paused at its yield: consistent
                    work = self.pool.submit(o.transform, batch) if self.pool and o.transform else batch
                    if not self._put((work, state)):
                        return
                epoch += 1
                # A position saved right after an epoch's last batch resumes into an empty rest of
                # that epoch; two empty passes in a row mean no data at all (never spin).
                empty = empty + 1 if n == 0 else 0
                if empty == 2:
                    break
            self._put((_END, None))
        except BaseException as e:  # raised in the consumer, in order
            self._put((e, None))

    def next(self) -> Any:  # a batch, or _END
        work, state = self.q.get()
        if work is _END:
            return _END
        if isinstance(work, BaseException):
            raise work
        result = work.result() if self.pool else work
        return result, state

    def stop(self) -> None:
        self.stop_event.set()
        while True:  # unblock the producer, drop what was prepared ahead
            try:
                self.q.get_nowait()
            except queue.Empty:
                break
        self.thread.join()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
